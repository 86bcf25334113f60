// Package sim replays an outage of a dependency in virtual time and compares
// caller policies, from immediate retries to Spillway.
//
// It is a deterministic discrete-event simulation: Poisson arrivals of jobs
// (some with deadlines, some superseded by newer versions), a dependency
// with a concurrency, a service time, a cold start after recovery and a
// collapse under sustained overload, and a worker fleet scaled on queue depth
// as KEDA and the HPA do. The Spillway mechanisms are the shipped code,
// driven by a virtual clock: the control law of internal/control (the
// evaluator's Plan, over internal/breaker and internal/ramp) run every
// virtual second, with the Lua scripts' admission, probe and budget
// accounting; pkg/retry's backoff, budget and parking; and internal/policy's
// reading of a DependencyPolicy.
//
// A Scenario comes from a YAML file (LoadScenarioFile, ParseScenario) or is
// built in (Builtin, BuiltinNames). Run replays it once per Policy and
// returns a Report with one Result per policy. The same seed gives the same
// Report. docs/replay.md describes the model, the metrics and the drain-time
// forecast.
package sim

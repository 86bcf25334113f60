// Package controllers holds Spillway's two DependencyPolicy controllers.
//
// The Evaluator runs every evaluation interval and talks only to Redis: it
// reads what workers reported, steps the breaker and the ramp in a pure
// planner (Plan) and publishes the fleet's limit, so a slow or throttled API
// server never delays a limit. The PolicyReconciler holds the finalizer,
// writes status once per reconcile and bounds the consumers' autoscalers,
// KEDA ScaledObjects and HorizontalPodAutoscalers (Bounds, DesiredReplicas),
// and workloads without an autoscaler. The two share an Evaluations store:
// the evaluator remembers each policy's last evaluation there and triggers
// the policy reconciler whenever the outcome changes.
//
// Neither keeps essential state in memory: the breaker and the ramp live in
// Redis (and, as a fallback, in the policy's status), the user's replicas and
// the pinned minimum in annotations on the autoscalers.
//
// The files, by concern:
//
//   - evaluator.go: the Evaluator (one evaluation: read, plan, publish); plan.go
//     names the control law of internal/control; fleet.go the state published
//     outside it (the released state).
//   - store.go: Evaluations, what the evaluator hands the policy reconciler,
//     and each policy's gate, which lets no evaluation publish after the
//     release of a deleted policy.
//   - policy_controller.go: the PolicyReconciler's Reconcile; delete.go its
//     reconcileDelete; status.go the one updateStatus, which calls the pure
//     condition functions of conditions.go.
//   - watches.go: what enqueues the policy reconciler (policiesFor, the
//     autoscaler handler) and the field indexes.
//   - autoscaler.go: the two kinds of consumer (ScaledObject, HPA) behind
//     one small interface, and the refusal of an HPA KEDA owns.
//   - binding.go: pure planning of what Spillway writes to an autoscaler
//     (planBinding, planRelease, the patches, Bounds, DesiredReplicas) in
//     Replicas (replicas.go), with managedfields.go reading server-side
//     apply's bookkeeping; consumers.go
//     does the I/O (reads, applies, lets go), scale.go reads scale targets.
//   - workload.go: pure planning for workloads without an autoscaler
//     (scaleTargetRef consumers: planWorkload, planWorkloadRelease, the
//     refusal of a workload an autoscaler scales); workload_consumers.go
//     does their I/O through the scale subresource.
//   - admission.go: the validating admission webhook (ReplicasValidator),
//     served by every replica from its cache, which refuses a change above a
//     consumer's bound with a message that says why.
//   - signals.go and prometheus.go: the Prometheus signal (the Signals store
//     and the querier); limitedby.go the bounds of a fleet without the library.
//   - options.go: Options and their defaults; metrics.go: the metrics.
package controllers

// ControllerName names the controllers' logger and their Events.
const ControllerName = "spillway-controller"

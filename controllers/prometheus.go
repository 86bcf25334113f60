package controllers

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/api"
	promv1 "github.com/prometheus/client_golang/api/prometheus/v1"
	"github.com/prometheus/common/model"
)

// PrometheusTarget is a Prometheus server and the credentials it takes.
type PrometheusTarget struct {
	// Address is the base URL of its HTTP API.
	Address string
	// BearerToken, when set, is sent as "Authorization: Bearer ...".
	BearerToken string
	// Username and Password, when Username is set, are sent as basic
	// authentication.
	Username, Password string
}

// PrometheusQuerier runs a PromQL instant query that yields one value. The
// evaluator's signals go through it, so a test can count or fail queries;
// PrometheusHTTP is the real one.
type PrometheusQuerier interface {
	// QueryValue runs query at the server's current time and returns its one
	// value. It returns an error wrapping ErrNoData when the result is empty
	// or NaN, and a *SignalError saying whether the server could not be
	// reached or refused the query otherwise.
	QueryValue(ctx context.Context, target PrometheusTarget, query string) (float64, error)
}

// ErrNoData is a query that yielded nothing: an empty result, or NaN (an
// error ratio with no traffic is 0/0).
var ErrNoData = errors.New("the query returned no data")

// SignalError is a failed query with the SignalsHealthy reason it maps to:
// ReasonPrometheusUnreachable or ReasonQueryFailed.
type SignalError struct {
	Reason string
	Err    error
}

func (e *SignalError) Error() string { return e.Err.Error() }
func (e *SignalError) Unwrap() error { return e.Err }

// PrometheusHTTP queries Prometheus over its HTTP API with the official
// client (github.com/prometheus/client_golang/api). Its zero value is ready;
// all queries share one connection pool.
type PrometheusHTTP struct {
	// Transport carries the requests. Default: the client's
	// api.DefaultRoundTripper.
	Transport http.RoundTripper
}

// QueryValue implements PrometheusQuerier. The caller bounds it with ctx.
func (p PrometheusHTTP) QueryValue(ctx context.Context, target PrometheusTarget, query string) (float64, error) {
	rt := p.Transport
	if rt == nil {
		rt = api.DefaultRoundTripper
	}
	if target.BearerToken != "" || target.Username != "" {
		rt = credentialsRoundTripper{target: target, next: rt}
	}
	c, err := api.NewClient(api.Config{Address: target.Address, RoundTripper: rt})
	if err != nil {
		return 0, &SignalError{Reason: ReasonQueryFailed, Err: fmt.Errorf("invalid Prometheus address %q: %w", target.Address, err)}
	}
	v, _, _, err := promv1.NewAPI(c).Query(ctx, query, time.Time{})
	if err != nil {
		return 0, classifyQueryError(query, err)
	}
	return singleValue(query, v)
}

// classifyQueryError tells a query Prometheus refused or answered with
// something else than a query result (bad syntax, an execution error, a 4xx
// such as an authentication failure, a body that is not a query result: the
// address is not a Prometheus) from a Prometheus that could not be reached
// or did not answer (a network error, a timeout, a 5xx).
func classifyQueryError(query string, err error) error {
	var pe *promv1.Error
	if errors.As(err, &pe) {
		switch pe.Type {
		case promv1.ErrBadData, promv1.ErrExec, promv1.ErrClient, promv1.ErrBadResponse:
			return &SignalError{Reason: ReasonQueryFailed, Err: fmt.Errorf("prometheus refused %q: %w", query, err)}
		}
	}
	return &SignalError{Reason: ReasonPrometheusUnreachable, Err: fmt.Errorf("failed to query prometheus: %w", err)}
}

// singleValue is the one value of a query's result: a scalar, or a vector of
// exactly one sample.
func singleValue(query string, v model.Value) (float64, error) {
	var f float64
	switch v := v.(type) {
	case *model.Scalar:
		f = float64(v.Value)
	case model.Vector:
		switch len(v) {
		case 0:
			return 0, ErrNoData
		case 1:
			f = float64(v[0].Value)
		default:
			return 0, &SignalError{Reason: ReasonQueryFailed,
				Err: fmt.Errorf("%q yields %d series, not one: aggregate it, for example with sum()", query, len(v))}
		}
	default:
		return 0, &SignalError{Reason: ReasonQueryFailed, Err: fmt.Errorf("%q yields a %s, not a scalar or a vector of one sample", query, v.Type())}
	}
	switch {
	case math.IsNaN(f):
		return 0, ErrNoData
	case math.IsInf(f, 0):
		return 0, &SignalError{Reason: ReasonQueryFailed, Err: fmt.Errorf("%q yields %v", query, f)}
	}
	return f, nil
}

// credentialsRoundTripper adds a target's credentials to every request.
type credentialsRoundTripper struct {
	target PrometheusTarget
	next   http.RoundTripper
}

func (c credentialsRoundTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context())
	if c.target.BearerToken != "" {
		req.Header.Set("Authorization", "Bearer "+c.target.BearerToken)
	} else {
		req.SetBasicAuth(c.target.Username, c.target.Password)
	}
	return c.next.RoundTrip(req)
}

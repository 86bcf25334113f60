package guard

import (
	"context"
	"errors"
	"reflect"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// Classify is the default outcome classifier: nil and a Permanent error are
// successes (the dependency answered), a timeout is a timeout, anything else
// a failure. A timeout is context.DeadlineExceeded, an error whose Timeout()
// is true (net.Error, net/http's client timeout, os.ErrDeadlineExceeded) or
// a gRPC status error with code DeadlineExceeded, anywhere in the error's
// chain.
func Classify(err error) protocol.Outcome {
	switch {
	case err == nil, permanentOf(err) != nil:
		return protocol.Success
	case errors.Is(err, context.DeadlineExceeded), isTimeout(err):
		return protocol.Timeout
	}
	return protocol.Failure
}

// grpcDeadlineExceeded is gRPC's status code DEADLINE_EXCEEDED, fixed by
// the gRPC specification (codes.DeadlineExceeded in grpc-go).
const grpcDeadlineExceeded = 4

// isTimeout reports whether an error in err's chain says it is a timeout:
// its Timeout() is true, or it is a gRPC status whose code is
// DeadlineExceeded. The gRPC status is read through its GRPCStatus()
// method, the one grpc-go's status.FromError reads, by reflection: the
// worker library does not link grpc-go (pkg/guard/guardgrpc does).
func isTimeout(err error) bool {
	found := false
	walk(err, func(e error) bool {
		if t, ok := e.(interface{ Timeout() bool }); ok && t.Timeout() {
			found = true
		} else if code, ok := grpcCode(e); ok && code == grpcDeadlineExceeded {
			found = true
		}
		return found
	})
	return found
}

// walk calls f on err and every error it wraps, depth first, until f returns
// true.
func walk(err error, f func(error) bool) bool {
	if err == nil {
		return false
	}
	if f(err) {
		return true
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return walk(u.Unwrap(), f)
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if walk(e, f) {
				return true
			}
		}
	}
	return false
}

// grpcCode returns the code of err's own gRPC status: err has a method
// GRPCStatus() returning a non-nil value whose Code() is an unsigned
// integer (grpc-go's *status.Status and codes.Code).
func grpcCode(err error) (uint64, bool) {
	v := reflect.ValueOf(err)
	if v.Kind() == reflect.Pointer && v.IsNil() {
		return 0, false // a typed nil: its methods may not be callable
	}
	m := v.MethodByName("GRPCStatus")
	if !m.IsValid() || m.Type().NumIn() != 0 || m.Type().NumOut() != 1 {
		return 0, false
	}
	st := m.Call(nil)[0]
	if st.Kind() == reflect.Pointer && st.IsNil() {
		return 0, false
	}
	c := st.MethodByName("Code")
	if !c.IsValid() || c.Type().NumIn() != 0 || c.Type().NumOut() != 1 {
		return 0, false
	}
	switch code := c.Call(nil)[0]; code.Kind() {
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return code.Uint(), true
	}
	return 0, false
}

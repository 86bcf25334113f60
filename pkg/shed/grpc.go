package shed

import (
	"context"
	"errors"
	"strconv"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/spillway-dev/spillway/pkg/wire"
)

// UnaryServerInterceptor returns an interceptor that admits or rejects each
// unary call before its handler runs. Install it first (outermost) with
// grpc.ChainUnaryInterceptor so that shed calls cost as little as possible.
func (s *Shedder) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		t, err := s.Admit(ctx, s.grpcRequest(ctx))
		if err != nil {
			if md := trailer(err); md != nil {
				_ = grpc.SetTrailer(ctx, md) // fails only if the stream is already gone
			}
			return nil, grpcError(err)
		}
		defer t.Release()
		return handler(ctx, req)
	}
}

// StreamServerInterceptor returns an interceptor that admits or rejects each
// stream before its handler runs; an admitted stream holds its slot until the
// handler returns.
func (s *Shedder) StreamServerInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		ctx := ss.Context()
		t, err := s.Admit(ctx, s.grpcRequest(ctx))
		if err != nil {
			if md := trailer(err); md != nil {
				ss.SetTrailer(md)
			}
			return grpcError(err)
		}
		defer t.Release()
		return handler(srv, ss)
	}
}

// grpcRequest reads the caller key, grpc-previous-rpc-attempts and the
// deadline of an incoming call, counting a malformed attempt count.
func (s *Shedder) grpcRequest(ctx context.Context) Request {
	req := Request{Caller: first(metadata.ValueFromIncomingContext(ctx, s.callerMD)), Attempt: 1}
	if v := first(metadata.ValueFromIncomingContext(ctx, wire.PreviousAttemptsMetadata)); v != "" {
		if n, ok := parsePrevious(v); ok {
			req.Attempt = n + 1
		} else {
			s.metrics.malformedAttempt.Inc()
		}
	}
	req.Deadline, _ = ctx.Deadline()
	return req
}

// parsePrevious parses a count of previous attempts: like parseAttempt, but
// 0 is valid.
func parsePrevious(v string) (int, bool) {
	if v == "0" {
		return 0, true
	}
	return parseAttempt(v)
}

// trailer returns the retry-after and pushback trailer for a rejection that
// has a retry delay, or nil.
func trailer(err error) metadata.MD {
	var rej *Rejection
	if !errors.As(err, &rej) || rej.RetryAfter <= 0 {
		return nil
	}
	return metadata.Pairs(
		wire.RetryAfterMetadata, strconv.FormatInt(int64(rej.RetryAfter/time.Second), 10),
		wire.PushbackMetadata, strconv.FormatInt(rej.RetryAfter.Milliseconds(), 10),
	)
}

// grpcError returns the status error for a rejection.
func grpcError(err error) error {
	var rej *Rejection
	if errors.As(err, &rej) {
		return rej.GRPCStatus().Err()
	}
	return err
}

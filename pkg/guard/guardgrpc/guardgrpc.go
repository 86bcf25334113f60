// Package guardgrpc carries the worker library's attempt number on gRPC calls
// in the standard grpc-previous-rpc-attempts metadata
// (wire.PreviousAttemptsMetadata), which the dependency's
// middleware (pkg/shed) counts to measure retry amplification. The deadline
// travels as gRPC's own grpc-timeout.
//
// It is a package of its own so that workers that do not use gRPC do not link
// it. Retry at one layer only: when the worker library decides retries,
// leave grpc-go's retry policy off, or both layers multiply the attempts.
package guardgrpc

import (
	"context"
	"strconv"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// UnaryClientInterceptor sends the attempt number of the call's context
// (guard.AttemptFromContext) with every unary call.
func UnaryClientInterceptor() grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		return invoker(withPreviousAttempts(ctx), method, req, reply, cc, opts...)
	}
}

// StreamClientInterceptor sends the attempt number of the call's context with
// every stream.
func StreamClientInterceptor() grpc.StreamClientInterceptor {
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		return streamer(withPreviousAttempts(ctx), desc, cc, method, opts...)
	}
}

// withPreviousAttempts adds attempt − 1 as grpc-previous-rpc-attempts; a first
// attempt sends nothing, as gRPC does.
func withPreviousAttempts(ctx context.Context) context.Context {
	attempt := guard.AttemptFromContext(ctx)
	if attempt <= 1 {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, wire.PreviousAttemptsMetadata, strconv.Itoa(attempt-1))
}

package shed_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/spillway-dev/spillway/pkg/shed"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// BenchmarkMiddleware compares a bare handler with the same handler behind
// the Shedder on the admit path, calling ServeHTTP directly with a reused
// request and recorder so that only the middleware's overhead shows.
func BenchmarkMiddleware(b *testing.B) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	newReq := func(headers map[string]string) *http.Request {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		for k, v := range headers {
			r.Header.Set(k, v)
		}
		return r
	}
	withShedder := func(opts shed.Options) http.Handler {
		opts.Registerer = prometheus.NewRegistry()
		s, err := shed.New(opts)
		if err != nil {
			b.Fatalf("New: %v", err)
		}
		return s.Middleware(ok)
	}
	cases := []struct {
		name    string
		handler http.Handler
		req     *http.Request
	}{
		{"bare", ok, newReq(nil)},
		{"shed", withShedder(shed.Options{MaxInFlight: 1000}), newReq(map[string]string{wire.AttemptHeader: "2"})},
		{"shed_quota", withShedder(shed.Options{MaxInFlight: 1000, DefaultQuota: 10}),
			newReq(map[string]string{wire.AttemptHeader: "2", wire.DefaultCallerHeader: "caller-1"})},
		{"shed_deadline", withShedder(shed.Options{MaxInFlight: 1000}),
			newReq(map[string]string{wire.AttemptHeader: "2", wire.DeadlineHeader: time.Now().Add(time.Hour).UTC().Format(time.RFC3339Nano)})},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			w := httptest.NewRecorder()
			b.ReportAllocs()
			for b.Loop() {
				c.handler.ServeHTTP(w, c.req)
			}
		})
	}
}

// BenchmarkUnaryInterceptor measures the gRPC unary interceptor on the admit
// path against calling the handler directly.
func BenchmarkUnaryInterceptor(b *testing.B) {
	handler := func(context.Context, any) (any, error) { return nil, nil }
	s, err := shed.New(shed.Options{MaxInFlight: 1000, Registerer: prometheus.NewRegistry()})
	if err != nil {
		b.Fatalf("New: %v", err)
	}
	intercept := s.UnaryServerInterceptor()
	info := &grpc.UnaryServerInfo{FullMethod: "/grpc.health.v1.Health/Check"}
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(wire.PreviousAttemptsMetadata, "1", "x-api-key", "caller-1"))
	b.Run("bare", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, _ = handler(ctx, nil)
		}
	})
	b.Run("shed", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, _ = intercept(ctx, nil, info, handler)
		}
	})
}

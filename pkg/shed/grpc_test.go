package shed_test

import (
	"context"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/spillway-dev/spillway/pkg/shed"
	"github.com/spillway-dev/spillway/pkg/wire"
)

// healthServer is the service under test: the standard gRPC health service,
// whose Check and Watch optionally hold until release is closed.
type healthServer struct {
	healthpb.UnimplementedHealthServer
	release chan struct{} // nil: answer at once
	entered atomic.Int64
}

func (h *healthServer) Check(ctx context.Context, _ *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	h.entered.Add(1)
	h.hold(ctx)
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

func (h *healthServer) Watch(_ *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
	h.entered.Add(1)
	if err := stream.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}); err != nil {
		return err
	}
	h.hold(stream.Context())
	return nil
}

func (h *healthServer) hold(ctx context.Context) {
	if h.release == nil {
		return
	}
	select {
	case <-h.release:
	case <-ctx.Done():
	}
}

// startGRPC serves h on a 127.0.0.1 listener behind s's interceptors, with
// before as extra unary interceptors in front, and returns a client.
func startGRPC(t *testing.T, s *shed.Shedder, h *healthServer, dialOpts []grpc.DialOption, before ...grpc.UnaryServerInterceptor) healthpb.HealthClient {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(append(before, s.UnaryServerInterceptor())...),
		grpc.ChainStreamInterceptor(s.StreamServerInterceptor()),
	)
	healthpb.RegisterHealthServer(srv, h)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), append(dialOpts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return healthpb.NewHealthClient(conn)
}

// withKey returns ctx carrying the caller key metadata.
func withKey(ctx context.Context, key string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "x-api-key", key)
}

// checkRetryTrailer verifies the retry-after and pushback trailers of a
// rejected call.
func checkRetryTrailer(t *testing.T, md metadata.MD) {
	t.Helper()
	secs, err := strconv.Atoi(first(md.Get(wire.RetryAfterMetadata)))
	if err != nil || secs < 1 || secs > 10 {
		t.Fatalf("trailer %s = %q, want whole seconds in [1, 10]", wire.RetryAfterMetadata, md.Get(wire.RetryAfterMetadata))
	}
	if got := first(md.Get(wire.PushbackMetadata)); got != strconv.Itoa(secs*1000) {
		t.Fatalf("trailer %s = %q, want %d", wire.PushbackMetadata, got, secs*1000)
	}
}

func first(v []string) string {
	if len(v) == 0 {
		return ""
	}
	return v[0]
}

func TestGRPCUnaryQuotaAndOverload(t *testing.T) {
	s, reg := newShedder(t, shed.Options{MaxInFlight: 2, DefaultQuota: 1})
	h := &healthServer{release: make(chan struct{})}
	client := startGRPC(t, s, h, nil)
	ctx := t.Context()

	done := make(chan error, 2)
	go func() { _, err := client.Check(withKey(ctx, "a"), &healthpb.HealthCheckRequest{}); done <- err }()
	waitFor(t, "a admitted", func() bool { return h.entered.Load() == 1 })

	var trailer metadata.MD
	_, err := client.Check(withKey(ctx, "a"), &healthpb.HealthCheckRequest{}, grpc.Trailer(&trailer))
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a over its quota: %v, want RESOURCE_EXHAUSTED", err)
	}
	checkRetryTrailer(t, trailer)

	go func() { _, err := client.Check(withKey(ctx, "b"), &healthpb.HealthCheckRequest{}); done <- err }()
	waitFor(t, "b admitted", func() bool { return h.entered.Load() == 2 })

	trailer = nil
	_, err = client.Check(withKey(ctx, "c"), &healthpb.HealthCheckRequest{}, grpc.Trailer(&trailer))
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("c over MaxInFlight: %v, want UNAVAILABLE", err)
	}
	checkRetryTrailer(t, trailer)

	close(h.release)
	for range 2 {
		if err := <-done; err != nil {
			t.Fatalf("admitted call: %v", err)
		}
	}
	if got := metricValue(t, reg, "spillway_service_admitted_total", nil); got != 2 {
		t.Fatalf("admitted_total = %v, want 2", got)
	}
	if h.entered.Load() != 2 {
		t.Fatalf("handler reached %d times, want 2", h.entered.Load())
	}
}

func TestGRPCPastDeadlineNeverReachesHandler(t *testing.T) {
	s, reg := newShedder(t, shed.Options{MaxInFlight: 2})
	h := &healthServer{}
	// expire stands for a call whose grpc-timeout ran out before the
	// service got to it.
	expire := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		ctx, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Millisecond))
		defer cancel()
		return next(ctx, req)
	}
	client := startGRPC(t, s, h, nil, expire)
	_, err := client.Check(t.Context(), &healthpb.HealthCheckRequest{})
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("expired call: %v, want DEADLINE_EXCEEDED", err)
	}
	if n := h.entered.Load(); n != 0 {
		t.Fatalf("handler reached %d times, want 0", n)
	}
	if got := metricValue(t, reg, "spillway_service_shed_total", map[string]string{"reason": "deadline"}); got != 1 {
		t.Fatalf("shed_total{reason=deadline} = %v, want 1", got)
	}
}

func TestGRPCAttemptFromPreviousAttempts(t *testing.T) {
	s, reg := newShedder(t, shed.Options{MaxInFlight: 2})
	client := startGRPC(t, s, &healthServer{}, nil)
	for _, prev := range []string{"", "0", "1", "2", "7", "abc", "-1"} {
		ctx := t.Context()
		if prev != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, wire.PreviousAttemptsMetadata, prev)
		}
		if _, err := client.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			t.Fatalf("Check with previous attempts %q: %v", prev, err)
		}
	}
	for label, want := range map[string]float64{"1": 4, "2": 1, "3": 1, "4+": 1} {
		if got := metricValue(t, reg, "spillway_service_requests_total", map[string]string{"attempt": label}); got != want {
			t.Errorf("requests_total{attempt=%q} = %v, want %v", label, got, want)
		}
	}
	if got := metricValue(t, reg, "spillway_service_malformed_headers_total", map[string]string{"header": "attempt"}); got != 2 {
		t.Errorf("malformed_headers_total{header=attempt} = %v, want 2", got)
	}
}

// TestGRPCBuiltInRetryHonoursPushback shows that grpc-go's own retry policy
// waits the pushback the Shedder sends and reports its retry in
// grpc-previous-rpc-attempts.
func TestGRPCBuiltInRetryHonoursPushback(t *testing.T) {
	s, reg := newShedder(t, shed.Options{MaxInFlight: 1, RetryAfterMin: time.Second, RetryAfterMax: time.Second})
	h := &healthServer{release: make(chan struct{})}
	const serviceConfig = `{"methodConfig": [{
		"name": [{"service": "grpc.health.v1.Health"}],
		"retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
			"backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`
	client := startGRPC(t, s, h, []grpc.DialOption{grpc.WithDefaultServiceConfig(serviceConfig)})

	held := make(chan error, 1)
	go func() { _, err := client.Check(t.Context(), &healthpb.HealthCheckRequest{}); held <- err }()
	waitFor(t, "the slot taken", func() bool { return h.entered.Load() == 1 })

	start := time.Now()
	retried := make(chan error, 1)
	go func() { _, err := client.Check(t.Context(), &healthpb.HealthCheckRequest{}); retried <- err }()
	waitFor(t, "the first attempt shed", func() bool {
		return metricValue(t, reg, "spillway_service_shed_total", map[string]string{"reason": "overload"}) == 1
	})
	close(h.release)
	if err := <-retried; err != nil {
		t.Fatalf("retried call: %v, want success on the retry", err)
	}
	if elapsed := time.Since(start); elapsed < 900*time.Millisecond {
		t.Fatalf("retry came after %v, want about the 1s pushback", elapsed)
	}
	if err := <-held; err != nil {
		t.Fatalf("held call: %v", err)
	}
	if got := metricValue(t, reg, "spillway_service_requests_total", map[string]string{"attempt": "2"}); got != 1 {
		t.Fatalf("requests_total{attempt=2} = %v, want 1", got)
	}
}

func TestGRPCStreamQuota(t *testing.T) {
	s, _ := newShedder(t, shed.Options{MaxInFlight: 4, DefaultQuota: 1})
	h := &healthServer{release: make(chan struct{})}
	defer close(h.release)
	client := startGRPC(t, s, h, nil)

	ctx, cancel := context.WithCancel(withKey(t.Context(), "a"))
	defer cancel()
	admitted, err := client.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatalf("Watch: %v", err)
	}
	if _, err := admitted.Recv(); err != nil {
		t.Fatalf("first stream Recv: %v", err)
	}

	rejected, err := client.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatalf("Watch: %v", err)
	}
	if _, err := rejected.Recv(); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("second stream of a: %v, want RESOURCE_EXHAUSTED", err)
	}
	checkRetryTrailer(t, rejected.Trailer())
	if got := s.Stats().InFlight; got != 1 {
		t.Fatalf("InFlight = %d, want 1 (the open stream)", got)
	}
}

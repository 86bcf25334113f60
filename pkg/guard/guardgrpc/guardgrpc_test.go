package guardgrpc_test

import (
	"context"
	"net"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/guard/guardgrpc"
	"github.com/spillway-dev/spillway/pkg/shed"
)

// A gRPC service behind pkg/shed counts the worker's attempts as the worker
// library numbered them.
func TestAttemptsReachTheService(t *testing.T) {
	reg := prometheus.NewRegistry()
	s, err := shed.New(shed.Options{MaxInFlight: 4, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(s.UnaryServerInterceptor()))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()

	conn, err := grpc.NewClient(ln.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(guardgrpc.UnaryClientInterceptor()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	client := healthpb.NewHealthClient(conn)
	for _, attempt := range []int{1, 2, 3, 3, 9} {
		ctx := guard.WithAttempt(context.Background(), attempt)
		if _, err := client.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			t.Fatalf("attempt %d: %v", attempt, err)
		}
	}
	want := map[string]float64{"1": 1, "2": 1, "3": 2, "4+": 1}
	got := map[string]float64{}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "spillway_service_requests_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "attempt" {
					got[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	for label, n := range want {
		if got[label] != n {
			t.Errorf("requests_total{attempt=%q} = %v, want %v (all: %v)", label, got[label], n, got)
		}
	}
}

package guard_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/spillway-dev/spillway/pkg/guard"
	"github.com/spillway-dev/spillway/pkg/protocol"
)

// The errors below are made by the libraries themselves, on loopback, not
// built by hand, except where a gRPC status is what a server sends.

// calleeDeadline is a callee's own deadline passing inside the call.
func calleeDeadline(t *testing.T) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	<-ctx.Done()
	return fmt.Errorf("render template: %w", ctx.Err())
}

// netReadTimeout is a net.Conn read past its deadline: a *net.OpError whose
// Timeout() is true, wrapping os.ErrDeadlineExceeded, not
// context.DeadlineExceeded.
func netReadTimeout(t *testing.T) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	conn, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
	_, err = conn.Read(make([]byte, 1))
	return fmt.Errorf("read reply: %w", err)
}

// httpClientTimeout is net/http's Client.Timeout passing.
func httpClientTimeout(t *testing.T) error {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
	}))
	defer srv.Close()
	_, err := (&http.Client{Timeout: 20 * time.Millisecond}).Get(srv.URL)
	return err
}

// grpcDeadline is a gRPC call whose deadline passes while the server works:
// grpc-go returns a status error with code DeadlineExceeded, which does not
// wrap context.DeadlineExceeded.
func grpcDeadline(t *testing.T) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, _ grpc.UnaryHandler) (any, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	}))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("the gRPC call returned %v, want DeadlineExceeded", err)
	}
	return err
}

// TestDefaultClassifyTellsTimeouts keeps every client's timeout a timeout:
// the breaker counts timeouts and failures alike, but the metrics and the
// runbook tell them apart.
func TestDefaultClassifyTellsTimeouts(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  func(t *testing.T) error
		want protocol.Outcome
	}{
		{"nil", func(*testing.T) error { return nil }, protocol.Success},
		{"permanent", func(*testing.T) error { return guard.Permanent(errors.New("bad input")) }, protocol.Success},
		{"plain failure", func(*testing.T) error { return errors.New("500 internal server error") }, protocol.Failure},
		{"context.DeadlineExceeded from the callee", calleeDeadline, protocol.Timeout},
		{"net.Error Timeout() from a read deadline", netReadTimeout, protocol.Timeout},
		{"net/http Client.Timeout", httpClientTimeout, protocol.Timeout},
		{"gRPC DeadlineExceeded from a real call", grpcDeadline, protocol.Timeout},
		{"gRPC DeadlineExceeded sent by a server, wrapped", func(*testing.T) error {
			return fmt.Errorf("enrich: %w", status.Error(codes.DeadlineExceeded, "upstream deadline"))
		}, protocol.Timeout},
		{"gRPC Unavailable", func(*testing.T) error { return status.Error(codes.Unavailable, "connection refused") }, protocol.Failure},
		{"a net.Error that is no timeout", func(*testing.T) error {
			_, err := net.Dial("tcp", "127.0.0.1:1")
			return err
		}, protocol.Failure},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.err(t)
			if got := guard.Classify(err); got != tc.want {
				t.Errorf("Classify(%v) = %q, want %q", err, got, tc.want)
			}
		})
	}
}

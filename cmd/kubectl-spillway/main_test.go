package main

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"

	. "github.com/onsi/gomega"

	"github.com/spillway-dev/spillway/internal/status"
)

// TestRun: `kubectl spillway status` reaches the status command (its
// kubeconfig error proves it), help lists it, anything else is a usage
// error. internal/status tests the command against a real API server.
func TestRun(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "kubeconfig")
	tests := []struct {
		args       []string
		wantCode   int
		wantStdout string
		wantStderr string
	}{
		{args: []string{"status", "--kubeconfig", missing}, wantCode: status.ExitFailure, wantStderr: "kubectl spillway status: failed to read the kubeconfig"},
		{args: []string{"status", "-o", "xml"}, wantCode: status.ExitUsage, wantStderr: `kubectl spillway status: unknown output format "xml"`},
		{args: []string{"--help"}, wantCode: status.ExitOK, wantStdout: "  status "},
		{args: nil, wantCode: status.ExitUsage, wantStderr: "Usage: kubectl spillway"},
		{args: []string{"simulate"}, wantCode: status.ExitUsage, wantStderr: `unknown command "simulate"`},
	}
	for _, tt := range tests {
		t.Run(filepath.Join(tt.args...), func(t *testing.T) {
			g := NewWithT(t)
			var out, errOut bytes.Buffer
			g.Expect(run(context.Background(), tt.args, &out, &errOut)).To(Equal(tt.wantCode))
			g.Expect(out.String()).To(ContainSubstring(tt.wantStdout))
			g.Expect(errOut.String()).To(ContainSubstring(tt.wantStderr))
		})
	}
}

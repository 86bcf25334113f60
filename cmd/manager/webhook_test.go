package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/yaml"

	"github.com/spillway-dev/spillway/internal/proctest"
	"github.com/spillway-dev/spillway/internal/testenv"
)

// TestWebhookCertificateRotation runs two manager processes with the webhook
// and the certificate rotation on, against a real API server, as the chart
// deploys them (one Secret, created empty; the configuration of
// config/webhook): the rotation fills the Secret, injects its CA into the
// configuration, and both replicas, leader and standby, serve the webhook
// with a certificate for the Service's name, once the files are where the
// kubelet would mount them. Then the Secret loses its data, and a new CA
// and certificate are made and injected, with no person involved.
func TestWebhookCertificateRotation(t *testing.T) {
	g := NewWithT(t)
	e := startHAEnv(t)
	ctx := context.Background()

	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "spillway-webhook-server-cert"}}
	g.Expect(e.kube.Client.Create(ctx, secret)).To(Succeed())
	data, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "config", "webhook", "manifests.yaml"))
	g.Expect(err).NotTo(HaveOccurred())
	cfg := &admissionregistrationv1.ValidatingWebhookConfiguration{}
	g.Expect(yaml.UnmarshalStrict(data, cfg)).To(Succeed())
	cfg.Name = "spillway-validating-webhook-configuration-" + e.ns
	for i := range cfg.Webhooks {
		cfg.Webhooks[i].ClientConfig.Service.Namespace = e.ns
	}
	g.Expect(e.kube.Client.Create(ctx, cfg)).To(Succeed())
	t.Cleanup(func() { _ = e.kube.Client.Delete(context.Background(), cfg) })

	type replica struct {
		port    int
		certDir string
	}
	var replicas []replica
	for _, name := range []string{"a", "b"} {
		port, err := proctest.FreePort()
		g.Expect(err).NotTo(HaveOccurred())
		r := replica{port: port, certDir: filepath.Join(e.dir, name+"-certs")}
		g.Expect(os.MkdirAll(r.certDir, 0o755)).To(Succeed())
		e.startManager(name, "--webhook", "--webhook-namespace="+e.ns, "--webhook-port="+strconv.Itoa(port),
			"--webhook-cert-dir="+r.certDir, "--webhook-configuration="+cfg.Name)
		replicas = append(replicas, r)
	}

	// The rotation fills the Secret and injects the CA.
	ca := waitForRotation(g, e, cfg.Name, nil)

	// The kubelet would mount the Secret: copy it where each replica looks,
	// and both serve the webhook with a certificate the CA signed for the
	// Service's name.
	serverName := "spillway-webhook-service." + e.ns + ".svc"
	mount := func() {
		g.Expect(e.kube.Client.Get(ctx, types.NamespacedName{Namespace: e.ns, Name: secret.Name}, secret)).To(Succeed())
		for _, r := range replicas {
			for _, k := range []string{"tls.crt", "tls.key", "ca.crt"} {
				g.Expect(os.WriteFile(filepath.Join(r.certDir, k), secret.Data[k], 0o600)).To(Succeed())
			}
		}
	}
	mount()
	for _, r := range replicas {
		g.Eventually(func() error { return handshake(r.port, serverName, ca) }, 60*time.Second, 200*time.Millisecond).Should(Succeed(),
			"the replica on port %d serves the webhook", r.port)
	}

	// The certificate is lost: a new CA and certificate are made and
	// injected, and served once mounted.
	g.Expect(e.kube.Client.Get(ctx, types.NamespacedName{Namespace: e.ns, Name: secret.Name}, secret)).To(Succeed())
	secret.Data = nil
	g.Expect(e.kube.Client.Update(ctx, secret)).To(Succeed())
	renewed := waitForRotation(g, e, cfg.Name, ca)
	mount()
	for _, r := range replicas {
		g.Eventually(func() error { return handshake(r.port, serverName, renewed) }, 60*time.Second, 200*time.Millisecond).Should(Succeed())
	}
}

// waitForRotation waits until the webhook's Secret holds a CA other than
// old and every webhook of the configuration name carries it, and returns
// it.
func waitForRotation(g Gomega, e *haEnv, name string, old []byte) []byte {
	var ca []byte
	g.Eventually(func(g Gomega) {
		secret := &corev1.Secret{}
		g.Expect(e.kube.Client.Get(context.Background(), types.NamespacedName{Namespace: e.ns, Name: "spillway-webhook-server-cert"}, secret)).To(Succeed())
		g.Expect(secret.Data).To(HaveKey("tls.crt"))
		g.Expect(secret.Data).To(HaveKey("ca.crt"))
		g.Expect(bytes.Equal(secret.Data["ca.crt"], old)).To(BeFalse(), "a new CA")
		cfg := &admissionregistrationv1.ValidatingWebhookConfiguration{}
		g.Expect(e.kube.Client.Get(context.Background(), types.NamespacedName{Name: name}, cfg)).To(Succeed())
		for _, w := range cfg.Webhooks {
			g.Expect(w.ClientConfig.CABundle).To(Equal(secret.Data["ca.crt"]), "webhook %s has the CA", w.Name)
		}
		ca = secret.Data["ca.crt"]
	}, 60*time.Second, 200*time.Millisecond).Should(Succeed())
	return ca
}

// handshake dials the webhook server on port and checks its certificate
// against ca for serverName, as the API server does.
func handshake(port int, serverName string, ca []byte) error {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return fmt.Errorf("no CA")
	}
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: time.Second}, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)),
		&tls.Config{RootCAs: pool, ServerName: serverName, MinVersion: tls.VersionTLS12})
	if err != nil {
		return err
	}
	return conn.Close()
}

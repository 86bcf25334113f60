package main

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/open-policy-agent/cert-controller/pkg/rotator"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/webhook"

	"github.com/spillway-dev/spillway/controllers"
)

// webhookOptions say whether and how the manager serves the validating
// admission webhook (controllers.ReplicasValidator).
type webhookOptions struct {
	enabled   bool
	port      int
	certDir   string
	rotate    bool
	secret    string
	service   string
	config    string
	namespace string
}

// serviceAccountNamespace is where a pod finds its own namespace.
const serviceAccountNamespace = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

func (o *webhookOptions) bindFlags(fs *flag.FlagSet) {
	fs.BoolVar(&o.enabled, "webhook", false,
		"Serve the validating admission webhook that refuses a change above a consumer's bound (every replica serves it, leader or not).")
	fs.IntVar(&o.port, "webhook-port", 9443, "Port the webhook server listens on, with --webhook.")
	fs.StringVar(&o.certDir, "webhook-cert-dir", "/tmp/k8s-webhook-server/serving-certs",
		"Directory of the webhook's serving certificate (tls.crt, tls.key), typically a Secret mounted there; reloaded when it changes.")
	fs.BoolVar(&o.rotate, "webhook-cert-rotation", true,
		"With --webhook: make the webhook's CA and serving certificate, keep them in --webhook-cert-secret, rotate them before they expire and inject the CA into --webhook-configuration (cert-controller). False when cert-manager provides them.")
	fs.StringVar(&o.secret, "webhook-cert-secret", "spillway-webhook-server-cert", "Secret holding the webhook's certificates, in the manager's namespace.")
	fs.StringVar(&o.service, "webhook-service", "spillway-webhook-service", "Service the API server calls the webhook through, in the manager's namespace; the certificate's name.")
	fs.StringVar(&o.config, "webhook-configuration", "spillway-validating-webhook-configuration", "ValidatingWebhookConfiguration whose CA bundle the rotation fills.")
	fs.StringVar(&o.namespace, "webhook-namespace", "", "Namespace of the Secret and the Service; the manager's own namespace in a cluster.")
}

// server is the manager's webhook server: port, certificates and, like the
// metrics server, HTTP/1.1 only unless HTTP/2 is enabled.
func (o webhookOptions) server(enableHTTP2 bool) webhook.Server {
	opts := webhook.Options{Port: o.port, CertDir: o.certDir}
	if !enableHTTP2 {
		opts.TLSOpts = append(opts.TLSOpts, func(c *tls.Config) { c.NextProtos = []string{"http/1.1"} })
	}
	return webhook.NewServer(opts)
}

// setupWebhook registers the validating webhook and, with certificate
// rotation, cert-controller's rotator. The rotator runs on every replica
// (not only the leader): each must have the certificate before it serves,
// and they share one Secret, written with optimistic locking. The webhook is
// served once the certificate is in the directory, which the kubelet fills
// from the Secret; with cert-manager the pod starts only once it is.
func setupWebhook(mgr ctrl.Manager, o webhookOptions) error {
	if !o.enabled {
		return nil
	}
	register := func() {
		mgr.GetWebhookServer().Register(controllers.WebhookPath, &webhook.Admission{Handler: &controllers.ReplicasValidator{
			Client: mgr.GetClient(),
			Mapper: mgr.GetRESTMapper(),
		}})
	}
	if o.rotate {
		ns := o.namespace
		if ns == "" {
			b, err := os.ReadFile(serviceAccountNamespace)
			if err != nil {
				return fmt.Errorf("--webhook-cert-rotation needs --webhook-namespace outside a cluster: %w", err)
			}
			ns = strings.TrimSpace(string(b))
		}
		ready := make(chan struct{})
		if err := rotator.AddRotator(mgr, &rotator.CertRotator{
			SecretKey:             types.NamespacedName{Namespace: ns, Name: o.secret},
			CertDir:               o.certDir,
			CAName:                "spillway-webhook-ca",
			CAOrganization:        "spillway",
			DNSName:               fmt.Sprintf("%s.%s.svc", o.service, ns),
			ExtraDNSNames:         []string{fmt.Sprintf("%s.%s.svc.cluster.local", o.service, ns)},
			IsReady:               ready,
			Webhooks:              []rotator.WebhookInfo{{Name: o.config, Type: rotator.Validating}},
			FieldOwner:            "spillway-cert-rotator",
			RequireLeaderElection: false,
		}); err != nil {
			return fmt.Errorf("failed to set up the webhook's certificate rotation: %w", err)
		}
		// The webhook server reads its certificate when it starts: it is
		// added once the rotator has written the Secret and the kubelet has
		// put the files in the directory.
		return mgr.Add(afterReady{ready: ready, run: register})
	}
	register()
	return nil
}

// afterReady is a runnable of every replica (not only the leader) that
// calls run once ready is closed.
type afterReady struct {
	ready <-chan struct{}
	run   func()
}

func (a afterReady) Start(ctx context.Context) error {
	select {
	case <-a.ready:
		ctrl.Log.WithName("webhook").Info("The webhook's certificate is in place: serving the webhook")
		a.run()
	case <-ctx.Done():
	}
	return nil
}

func (afterReady) NeedLeaderElection() bool { return false }

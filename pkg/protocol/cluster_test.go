package protocol_test

import (
	"strings"
	"testing"
	"time"

	"github.com/spillway-dev/spillway/pkg/protocol"
)

// crc16 is CRC-16/XMODEM, the checksum Redis Cluster hashes keys with.
func crc16(b []byte) uint16 {
	var crc uint16
	for _, c := range b {
		crc ^= uint16(c) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}

// keySlot is the cluster slot of key, honouring a {hash tag}.
func keySlot(key string) int {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	return int(crc16([]byte(key)) % 16384)
}

func allKeys(c *protocol.Client) []string {
	k := c.Keys()
	return []string{k.State, k.Leases, k.GCRA, k.Stats, k.Probes, k.Pools, k.Wants, k.Callers, k.Changes, k.Job("order-42"), k.Job("")}
}

func TestKeysShareOneSlot(t *testing.T) {
	t.Parallel()
	if got := crc16([]byte("123456789")); got != 0x31C3 {
		t.Fatalf("crc16 check value = %#x, want 0x31c3", got)
	}
	_, rdb := sharedCluster(t)
	ctx := ctxT(t)
	for _, d := range []protocol.Dependency{
		{Namespace: "shop", Name: "payments"},
		{Namespace: "a", Name: "b"},
		{Namespace: "team-x", Name: "api.example.com"},
	} {
		c, err := protocol.NewClient(rdb, d)
		if err != nil {
			t.Fatal(err)
		}
		want := keySlot("{" + d.String() + "}")
		for _, k := range allKeys(c) {
			if !strings.HasPrefix(k, protocol.KeyPrefix+"{"+d.String()+"}:") {
				t.Errorf("key %q does not start with %q", k, protocol.KeyPrefix+"{"+d.String()+"}:")
			}
			if got := keySlot(k); got != want {
				t.Errorf("key %q hashes to slot %d, want %d", k, got, want)
			}
			server, err := rdb.ClusterKeySlot(ctx, k).Result()
			if err != nil {
				t.Fatal(err)
			}
			if int(server) != want {
				t.Errorf("CLUSTER KEYSLOT %q = %d, want %d", k, server, want)
			}
		}
	}
	k := protocol.KeysFor(protocol.Dependency{Namespace: "shop", Name: "payments"})
	if k.State != "spillway:v4:{shop/payments}:state" || k.Leases != "spillway:v4:{shop/payments}:leases" ||
		k.GCRA != "spillway:v4:{shop/payments}:gcra" || k.Stats != "spillway:v4:{shop/payments}:stats" ||
		k.Probes != "spillway:v4:{shop/payments}:probes" || k.Job("j") != "spillway:v4:{shop/payments}:job:j" {
		t.Errorf("key layout changed: %+v %s", k, k.Job("j"))
	}
}

// TestClusterDependenciesIndependent takes two dependencies served by two
// different masters and checks that each has its own limit, and that every
// key a script wrote lives on its dependency's master.
func TestClusterDependenciesIndependent(t *testing.T) {
	t.Parallel()
	cl, rdb := sharedCluster(t)
	ctx := ctxT(t)
	nodes := cl.Nodes()
	nodeOf := func(slot int) int { return slot * len(nodes) / 16384 }

	var a, b *protocol.Client
	for a == nil || b == nil {
		c := newClient(t, rdb)
		n := nodeOf(keySlot(c.Keys().State))
		switch {
		case a == nil:
			a = c
		case n != nodeOf(keySlot(a.Keys().State)):
			b = c
		}
	}
	for _, c := range []*protocol.Client{a, b} {
		mustPublish(t, c, policy(1))
	}
	heldA := mustAdmit(t, a, 10*time.Second)
	if r := mustAcquire(t, a, time.Second); r.Code != protocol.RefusedThrottled {
		t.Fatalf("second call on A = %v, want throttled", r.Code)
	}
	heldB := mustAdmit(t, b, 10*time.Second) // A's full slot does not affect B
	mustRelease(t, a, heldA, protocol.Failure, 1)
	mustAdmit(t, a, 10*time.Second)
	if r := mustAcquire(t, b, time.Second); r.Code != protocol.RefusedThrottled {
		t.Errorf("second call on B = %v, want throttled", r.Code)
	}
	mustRelease(t, b, heldB, protocol.Success, 1)
	if _, err := a.RetryBudget(ctx); err != nil {
		t.Fatal(err)
	}
	wa, _ := mustWindow(t, a, time.Minute, time.Time{})
	wb, _ := mustWindow(t, b, time.Minute, time.Time{})
	if wa.Failures != 1 || wa.Successes != 0 || wa.RetriesGranted != 1 || wb.Successes != 1 || wb.Failures != 0 || wb.RetriesGranted != 0 {
		t.Errorf("windows mixed up: A %+v, B %+v", wa, wb)
	}

	// Each dependency's keys are on its own master: asking that master
	// directly finds them; asking another answers MOVED.
	for _, c := range []*protocol.Client{a, b} {
		owner := nodeOf(keySlot(c.Keys().State))
		for i, n := range nodes {
			direct := n.Client()
			for _, k := range []string{c.Keys().State, c.Keys().Stats} {
				got, err := direct.Exists(ctx, k).Result()
				if i == owner && (err != nil || got != 1) {
					t.Errorf("EXISTS %s on its master = %d, %v", k, got, err)
				}
				if i != owner && (err == nil || !strings.Contains(err.Error(), "MOVED")) {
					t.Errorf("EXISTS %s on node %d = %d, %v; want MOVED", k, i, got, err)
				}
			}
		}
	}
}

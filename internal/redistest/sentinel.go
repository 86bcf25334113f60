package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/proctest"
)

const (
	// SentinelMasterName is the name the sentinels monitor the master under.
	SentinelMasterName = "spillway"
	// SentinelDownAfter is the sentinels' down-after-milliseconds: how long
	// the master may not answer before a sentinel thinks it down.
	SentinelDownAfter = time.Second
	// SentinelFailoverTimeout is the sentinels' failover-timeout.
	SentinelFailoverTimeout = 5 * time.Second
	// sentinelCount is the number of sentinels; sentinelQuorum of them must
	// agree that the master is down.
	sentinelCount, sentinelQuorum = 3, 2
	// sentinelTimeout bounds how long the sentinels may take to find the
	// replica and each other.
	sentinelTimeout = 30 * time.Second
)

// Sentinel is a Sentinel-managed Redis: a master, one replica, and three
// sentinels that monitor the master as [SentinelMasterName] with quorum 2, a
// down-after-milliseconds of [SentinelDownAfter] and a failover-timeout of
// [SentinelFailoverTimeout]. Every process listens on its own loopback port.
// Its methods are safe for concurrent use.
//
// The sentinels run `redis-sentinel sentinel.conf`, from $REDIS_SENTINEL, else
// PATH; without a redis-sentinel binary they run `redis-server sentinel.conf
// --sentinel`, which is the same program (Debian's redis-sentinel package
// ships redis-sentinel as a link to the binary that redis-server links to).
type Sentinel struct {
	servers   []*Server // the master first, then the replica
	sentinels []*sentinelProc

	mu      sync.Mutex
	clients []*redis.Client
	closed  bool
}

// NewSentinel starts the master and the replica (each a [Server] started with
// opts), waits until the replica has synchronised, starts the sentinels, and
// waits until every sentinel knows the replica and the other sentinels, so
// that a failover can happen. The caller must call Close.
func NewSentinel(opts ...Option) (*Sentinel, error) {
	s := &Sentinel{}
	master, err := StartServer(opts...)
	if err != nil {
		return nil, fmt.Errorf("start master: %w", err)
	}
	s.servers = append(s.servers, master)
	host, port, _ := net.SplitHostPort(master.Addr())
	replica, err := StartServer(append(append([]Option(nil), opts...), WithArgs("--replicaof", host, port))...)
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("start replica: %w", err)
	}
	s.servers = append(s.servers, replica)

	ctx, cancel := context.WithTimeout(context.Background(), sentinelTimeout)
	defer cancel()
	if err := waitReplicaSynced(ctx, replica.Addr()); err != nil {
		s.Close()
		return nil, err
	}
	bin, sentinelFlag, err := lookupSentinel(opts)
	if err != nil {
		s.Close()
		return nil, err
	}
	for i := range sentinelCount {
		p, err := startSentinel(bin, sentinelFlag, master.Addr())
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("start sentinel %d: %w", i, err)
		}
		s.sentinels = append(s.sentinels, p)
	}
	if err := s.waitMonitoring(ctx); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// StartSentinel is [NewSentinel] for tests: it fails tb if the processes
// cannot start, and stops them and closes the clients when the test ends. If
// the test failed, the end of every log is added to the test output.
func StartSentinel(tb testing.TB, opts ...Option) *Sentinel {
	tb.Helper()
	s, err := NewSentinel(opts...)
	if err != nil {
		tb.Fatalf("redistest: %v", withHint(err))
	}
	tb.Cleanup(func() {
		if tb.Failed() {
			for _, n := range s.servers {
				tb.Logf("redistest: last lines of the log of redis-server %s:\n%s", n.Addr(), proctest.Tail(n.logPath, 30))
			}
			for _, p := range s.sentinels {
				tb.Logf("redistest: last lines of the log of sentinel %s:\n%s", p.addr(), proctest.Tail(p.logPath, 30))
			}
		}
		if err := s.Close(); err != nil {
			tb.Errorf("redistest: %v", err)
		}
	})
	return s
}

// MasterName is the name the sentinels know the master by.
func (s *Sentinel) MasterName() string { return SentinelMasterName }

// SentinelAddrs returns the sentinels' "127.0.0.1:port" addresses.
func (s *Sentinel) SentinelAddrs() []string {
	addrs := make([]string, len(s.sentinels))
	for i, p := range s.sentinels {
		addrs[i] = p.addr()
	}
	return addrs
}

// Servers returns the data nodes: the first master, then the first replica.
// Which of them is master now is what [Sentinel.MasterAddr] says.
func (s *Sentinel) Servers() []*Server { return append([]*Server(nil), s.servers...) }

// Client returns a go-redis failover client that finds the master through the
// sentinels, closed by Close. Each modify function may adjust the options.
func (s *Sentinel) Client(modify ...func(*redis.FailoverOptions)) *redis.Client {
	opts := &redis.FailoverOptions{MasterName: SentinelMasterName, SentinelAddrs: s.SentinelAddrs()}
	for _, m := range modify {
		m(opts)
	}
	c := redis.NewFailoverClient(opts)
	s.mu.Lock()
	s.clients = append(s.clients, c)
	s.mu.Unlock()
	return c
}

// MasterAddr asks the sentinels which address is master, and returns the
// answer of the first one that replies.
func (s *Sentinel) MasterAddr(ctx context.Context) (string, error) {
	var errs []error
	for _, p := range s.sentinels {
		addr, err := p.masterAddr(ctx)
		if err == nil {
			return addr, nil
		}
		errs = append(errs, err)
	}
	return "", fmt.Errorf("no sentinel named the master: %w", errors.Join(errs...))
}

// KillMaster kills the current master with SIGKILL, as in a crash, and
// returns it. Its data, and any write not yet replicated, are lost.
func (s *Sentinel) KillMaster(ctx context.Context) (*Server, error) {
	addr, err := s.MasterAddr(ctx)
	if err != nil {
		return nil, err
	}
	for _, n := range s.servers {
		if n.Addr() == addr {
			n.Stop()
			return n, nil
		}
	}
	return nil, fmt.Errorf("the sentinels name %s as master, which is none of the servers", addr)
}

// WaitFailover waits until every sentinel names a master other than old and
// that master answers as one (INFO replication says role:master). It returns
// the new master's address.
func (s *Sentinel) WaitFailover(ctx context.Context, old string) (string, error) {
	for {
		addr, err := s.agreedMaster(ctx)
		if err == nil && addr == old {
			err = fmt.Errorf("the sentinels still name %s", old)
		}
		if err == nil {
			err = checkRole(ctx, addr, "master")
		}
		if err == nil {
			return addr, nil
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("no failover from %s: %w (last: %w)", old, ctx.Err(), err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// agreedMaster returns the master that every sentinel names.
func (s *Sentinel) agreedMaster(ctx context.Context) (string, error) {
	var agreed string
	for _, p := range s.sentinels {
		addr, err := p.masterAddr(ctx)
		if err != nil {
			return "", err
		}
		if agreed != "" && addr != agreed {
			return "", fmt.Errorf("sentinels disagree: %s and %s", agreed, addr)
		}
		agreed = addr
	}
	return agreed, nil
}

// Close closes the clients made by Client, and stops the sentinels and the
// servers. It is safe to call more than once.
func (s *Sentinel) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	for _, c := range s.clients {
		c.Close() // fails only if the caller closed it already
	}
	s.clients = nil
	var errs []error
	for _, p := range s.sentinels {
		errs = append(errs, p.close())
	}
	for _, n := range s.servers {
		errs = append(errs, n.Close())
	}
	return errors.Join(errs...)
}

// waitMonitoring waits until every sentinel sees the replica and the other
// sentinels and reports that the quorum can authorise a failover.
func (s *Sentinel) waitMonitoring(ctx context.Context) error {
	for {
		err := s.monitoring(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("sentinels not ready within %v: %w", sentinelTimeout, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (s *Sentinel) monitoring(ctx context.Context) error {
	for _, p := range s.sentinels {
		c := p.client()
		replicas, err := c.Replicas(ctx, SentinelMasterName).Result()
		if err != nil {
			c.Close()
			return fmt.Errorf("sentinel %s: replicas: %w", p.addr(), err)
		}
		others, err := c.Sentinels(ctx, SentinelMasterName).Result()
		if err != nil {
			c.Close()
			return fmt.Errorf("sentinel %s: sentinels: %w", p.addr(), err)
		}
		quorum, err := c.CkQuorum(ctx, SentinelMasterName).Result()
		c.Close()
		switch {
		case err != nil:
			return fmt.Errorf("sentinel %s: ckquorum: %w", p.addr(), err)
		case len(replicas) < len(s.servers)-1 || len(others) < sentinelCount-1:
			return fmt.Errorf("sentinel %s knows %d replicas and %d other sentinels (%s)", p.addr(), len(replicas), len(others), quorum)
		}
	}
	return nil
}

// sentinelProc is one sentinel process.
type sentinelProc struct {
	dir, logPath string
	port         int
	proc         *proctest.Proc
}

func (p *sentinelProc) addr() string { return "127.0.0.1:" + strconv.Itoa(p.port) }

// client returns a sentinel client for p that fails fast.
func (p *sentinelProc) client() *redis.SentinelClient {
	return redis.NewSentinelClient(&redis.Options{
		Addr:                  p.addr(),
		DialTimeout:           time.Second,
		ReadTimeout:           time.Second,
		WriteTimeout:          time.Second,
		ContextTimeoutEnabled: true,
		MaxRetries:            -1,
		PoolSize:              1,
	})
}

func (p *sentinelProc) masterAddr(ctx context.Context) (string, error) {
	c := p.client()
	defer c.Close()
	hostPort, err := c.GetMasterAddrByName(ctx, SentinelMasterName).Result()
	if err != nil {
		return "", fmt.Errorf("sentinel %s: get-master-addr-by-name: %w", p.addr(), err)
	}
	if len(hostPort) != 2 {
		return "", fmt.Errorf("sentinel %s: get-master-addr-by-name replied %q", p.addr(), hostPort)
	}
	return net.JoinHostPort(hostPort[0], hostPort[1]), nil
}

func (p *sentinelProc) close() error {
	p.proc.Kill()
	if err := os.RemoveAll(p.dir); err != nil {
		return fmt.Errorf("remove sentinel dir: %w", err)
	}
	return nil
}

// lookupSentinel finds the sentinel binary: $REDIS_SENTINEL, then
// redis-sentinel on PATH, then the redis-server binary with --sentinel.
func lookupSentinel(opts []Option) (bin string, sentinelFlag bool, err error) {
	if bin := os.Getenv("REDIS_SENTINEL"); bin != "" {
		if _, err := os.Stat(bin); err != nil {
			return "", false, fmt.Errorf("REDIS_SENTINEL=%s: %w", bin, err)
		}
		return bin, false, nil
	}
	if bin, err := exec.LookPath("redis-sentinel"); err == nil {
		return bin, false, nil
	}
	cfg, err := newConfig(opts)
	if err != nil {
		return "", false, err
	}
	return cfg.binary, true, nil
}

// startSentinel starts a sentinel monitoring master on a free port, trying
// other ports while the one it picked is taken.
func startSentinel(bin string, sentinelFlag bool, master string) (*sentinelProc, error) {
	dir, err := os.MkdirTemp("", "redistest-sentinel-")
	if err != nil {
		return nil, fmt.Errorf("create temp dir: %w", err)
	}
	const attempts = 5
	for i := 1; ; i++ {
		port, err := proctest.FreePort()
		var p *sentinelProc
		if err == nil {
			p, err = runSentinel(bin, sentinelFlag, dir, port, master)
		}
		if err == nil {
			return p, nil
		}
		if !errors.Is(err, errPortTaken) || i == attempts {
			os.RemoveAll(dir)
			return nil, err
		}
	}
}

func runSentinel(bin string, sentinelFlag bool, dir string, port int, master string) (*sentinelProc, error) {
	host, masterPort, err := net.SplitHostPort(master)
	if err != nil {
		return nil, err
	}
	p := &sentinelProc{dir: dir, logPath: filepath.Join(dir, "sentinel.log"), port: port}
	// Sentinel rewrites its configuration file as it learns the topology, so
	// the file is its own and writable.
	conf := strings.Join([]string{
		"port " + strconv.Itoa(port),
		"bind 127.0.0.1",
		"protected-mode no",
		"daemonize no",
		"dir " + dir,
		"logfile " + p.logPath,
		"loglevel notice",
		fmt.Sprintf("sentinel monitor %s %s %s %d", SentinelMasterName, host, masterPort, sentinelQuorum),
		fmt.Sprintf("sentinel down-after-milliseconds %s %d", SentinelMasterName, SentinelDownAfter.Milliseconds()),
		fmt.Sprintf("sentinel failover-timeout %s %d", SentinelMasterName, SentinelFailoverTimeout.Milliseconds()),
		fmt.Sprintf("sentinel parallel-syncs %s 1", SentinelMasterName),
	}, "\n") + "\n"
	confPath := filepath.Join(dir, "sentinel.conf")
	if err := os.WriteFile(confPath, []byte(conf), 0o600); err != nil {
		return nil, fmt.Errorf("write sentinel.conf: %w", err)
	}
	logStart := int64(0)
	if fi, err := os.Stat(p.logPath); err == nil {
		logStart = fi.Size()
	}
	args := []string{confPath}
	if sentinelFlag {
		args = append(args, "--sentinel")
	}
	logFile, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open sentinel log: %w", err)
	}
	defer logFile.Close()
	p.proc, err = proctest.Start(bin, args, dir, logFile)
	if err != nil {
		return nil, err
	}
	if err := waitReady(p.addr(), p.proc.Pid(), p.proc.Exited()); err != nil {
		p.proc.Kill()
		if errors.Is(err, errPortTaken) || strings.Contains(proctest.ReadFrom(p.logPath, logStart), "Address already in use") {
			return nil, fmt.Errorf("sentinel on port %d: %w", port, errPortTaken)
		}
		return nil, fmt.Errorf("sentinel on port %d did not start: %w\nend of its log:\n%s", port, err, proctest.Tail(p.logPath, 20))
	}
	return p, nil
}

// waitReplicaSynced waits until the replica at addr reports its link to the
// master up.
func waitReplicaSynced(ctx context.Context, addr string) error {
	for {
		err := checkReplicaLink(ctx, addr)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("replica %s not in sync within %v: %w", addr, sentinelTimeout, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func checkReplicaLink(ctx context.Context, addr string) error {
	info, err := replicationInfo(ctx, addr)
	if err != nil {
		return err
	}
	if got := infoField(info, "master_link_status"); got != "up" {
		return fmt.Errorf("replica %s has master_link_status:%s", addr, got)
	}
	return nil
}

// checkRole reports whether the server at addr has role.
func checkRole(ctx context.Context, addr, role string) error {
	info, err := replicationInfo(ctx, addr)
	if err != nil {
		return err
	}
	if got := infoField(info, "role"); got != role {
		return fmt.Errorf("%s has role:%s, want %s", addr, got, role)
	}
	return nil
}

func replicationInfo(ctx context.Context, addr string) (string, error) {
	c := redis.NewClient(&redis.Options{
		Addr:                  addr,
		DialTimeout:           time.Second,
		ReadTimeout:           time.Second,
		WriteTimeout:          time.Second,
		ContextTimeoutEnabled: true,
		DialerRetries:         1,
		MaxRetries:            -1,
		PoolSize:              1,
	})
	defer c.Close()
	info, err := c.Info(ctx, "replication").Result()
	if err != nil {
		return "", fmt.Errorf("info replication on %s: %w", addr, err)
	}
	return info, nil
}

package redistest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/internal/proctest"
)

// errPortTaken reports that another process holds the port redis-server was
// told to listen on; the caller picks another port or tries again later.
var errPortTaken = errors.New("port already in use")

// Server is one redis-server process listening on 127.0.0.1.
// Its methods are safe for concurrent use.
type Server struct {
	cfg     config
	dir     string // working directory: log, and nodes.conf in cluster mode
	logPath string

	mu      sync.Mutex
	port    int
	proc    *proctest.Proc // nil while stopped
	clients []*redis.Client
	closed  bool
}

// StartServer starts redis-server on a free loopback port in a new temporary
// directory and waits until it answers. The caller must call Close.
func StartServer(opts ...Option) (*Server, error) {
	cfg, err := newConfig(opts)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "redistest-")
	if err != nil {
		return nil, fmt.Errorf("create temp dir: %w", err)
	}
	s := &Server{cfg: cfg, dir: dir, logPath: filepath.Join(dir, "redis.log")}

	s.mu.Lock()
	defer s.mu.Unlock()
	const attempts = 5
	for i := 1; ; i++ {
		port, err := proctest.FreePort()
		if err == nil {
			err = s.start(port)
		}
		if err == nil {
			return s, nil
		}
		if !errors.Is(err, errPortTaken) || i == attempts {
			os.RemoveAll(dir)
			return nil, err
		}
	}
}

// Start is [StartServer] for tests: it fails tb if the server cannot start,
// and stops the server and closes its clients when the test ends. If the test
// failed, the end of the server's log is added to the test output.
func Start(tb testing.TB, opts ...Option) *Server {
	tb.Helper()
	s, err := StartServer(opts...)
	if err != nil {
		tb.Fatalf("redistest: %v", withHint(err))
	}
	tb.Cleanup(func() {
		if tb.Failed() {
			tb.Logf("redistest: last lines of the log of redis-server %s:\n%s", s.Addr(), proctest.Tail(s.logPath, 30))
		}
		if err := s.Close(); err != nil {
			tb.Errorf("redistest: %v", err)
		}
	})
	return s
}

// Addr returns the server's "127.0.0.1:port" address. It does not change
// across Stop and Restart.
func (s *Server) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.addr()
}

func (s *Server) addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// Client returns a new go-redis client for the server, closed by Close. Each
// modify function may adjust the options first, for example to set
// ContextTimeoutEnabled or MaxRetries.
func (s *Server) Client(modify ...func(*redis.Options)) *redis.Client {
	opts := &redis.Options{Addr: s.Addr()}
	for _, m := range modify {
		m(opts)
	}
	c := redis.NewClient(opts)
	s.mu.Lock()
	s.clients = append(s.clients, c)
	s.mu.Unlock()
	return c
}

// Stop kills the server (SIGKILL, as in a crash) and waits for it to exit.
// Its data is lost. Clients then fail to connect until Restart. Stopping a
// stopped server does nothing.
//
// With go-redis defaults a command takes about 2 s to fail against a stopped
// server (dial and command retries); a client made with MaxRetries -1 and
// DialerRetries 1 fails at once.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stop()
}

// Restart stops the server if it is running and starts it again, empty, on
// the same address. It retries for a few seconds while the port is busy.
func (s *Server) Restart() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return errors.New("restart redis-server: server is closed")
	}
	s.stop()
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := s.start(s.port)
		if err == nil || !errors.Is(err, errPortTaken) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Pause freezes the server with SIGSTOP. It keeps accepting connections (the
// kernel completes them) but answers nothing until Resume, like a hung Redis.
func (s *Server) Pause() error { return s.signal(syscall.SIGSTOP) }

// Resume lets a paused server continue with SIGCONT; it then answers the
// commands that queued up meanwhile.
func (s *Server) Resume() error { return s.signal(syscall.SIGCONT) }

// Promote gives the server a new replication id with its data kept, as a
// replica promoted by a failover gets one: REPLICAOF an address nobody
// listens on (port 1), then REPLICAOF NO ONE. The commands before, if any,
// run in the same MULTI/EXEC, so that no client command comes between
// them and the promotion: they turn the data into what a replica would
// hold (the writes it missed undone). It returns the new id.
func (s *Server) Promote(ctx context.Context, before ...func(redis.Pipeliner)) (string, error) {
	c := s.Client()
	defer c.Close()
	old, err := ReplicationID(ctx, c)
	if err != nil {
		return "", err
	}
	_, err = c.TxPipelined(ctx, func(p redis.Pipeliner) error {
		for _, f := range before {
			f(p)
		}
		p.SlaveOf(ctx, "127.0.0.1", "1")
		p.SlaveOf(ctx, "NO", "ONE")
		return nil
	})
	if err != nil {
		return "", fmt.Errorf("promote redis-server %s: %w", s.addr(), err)
	}
	id, err := ReplicationID(ctx, c)
	if err == nil && id == old {
		err = fmt.Errorf("promote redis-server %s: the replication id stayed %s", s.addr(), old)
	}
	return id, err
}

// ReplicationID is the server's master_replid (INFO replication).
func ReplicationID(ctx context.Context, c redis.Cmdable) (string, error) {
	info, err := c.Info(ctx, "replication").Result()
	if err != nil {
		return "", fmt.Errorf("read the replication id: %w", err)
	}
	for l := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), "master_replid:"); ok {
			return v, nil
		}
	}
	return "", fmt.Errorf("no master_replid in INFO replication: %q", info)
}

// Close closes the clients made by Client, stops the server and removes its
// directory. It is safe to call more than once.
func (s *Server) Close() error {
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
	s.stop()
	if err := os.RemoveAll(s.dir); err != nil {
		return fmt.Errorf("remove redis-server dir: %w", err)
	}
	return nil
}

func (s *Server) signal(sig syscall.Signal) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return fmt.Errorf("send %v to redis-server %s: not running", sig, s.addr())
	}
	if err := s.proc.Signal(sig); err != nil {
		return fmt.Errorf("send %v to redis-server %s: %w", sig, s.addr(), err)
	}
	return nil
}

// args returns redis-server's command line for port: loopback only, no
// persistence, logging to the server's directory.
func (s *Server) args(port int) []string {
	args := []string{
		"--port", strconv.Itoa(port),
		"--bind", "127.0.0.1",
		"--protected-mode", "no",
		"--daemonize", "no",
		"--dir", s.dir,
		"--save", "",
		"--appendonly", "no",
		"--loglevel", "warning",
		"--logfile", s.logPath,
	}
	if s.cfg.cluster {
		args = append(args,
			"--cluster-enabled", "yes",
			"--cluster-config-file", filepath.Join(s.dir, "nodes.conf"),
			"--cluster-node-timeout", "5000",
			"--cluster-announce-ip", "127.0.0.1",
		)
	}
	return append(args, s.cfg.extraArgs...)
}

// start runs redis-server on port and waits until it answers. It returns an
// error wrapping errPortTaken if the port is busy. s.mu must be held.
func (s *Server) start(port int) error {
	logFile, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("open redis-server log: %w", err)
	}
	defer logFile.Close()
	logStart, err := logFile.Seek(0, io.SeekEnd)
	if err != nil {
		return fmt.Errorf("open redis-server log: %w", err)
	}

	// Errors before redis-server opens its log (bad arguments) go to the log too.
	proc, err := proctest.Start(s.cfg.binary, s.args(port), s.dir, logFile)
	if err != nil {
		return err
	}
	s.proc, s.port = proc, port

	if err := waitReady(s.addr(), proc.Pid(), proc.Exited()); err != nil {
		s.stop()
		if errors.Is(err, errPortTaken) || strings.Contains(proctest.ReadFrom(s.logPath, logStart), "Address already in use") {
			return fmt.Errorf("redis-server on port %d: %w", port, errPortTaken)
		}
		return fmt.Errorf("redis-server on port %d did not start: %w\nend of its log:\n%s",
			port, err, proctest.Tail(s.logPath, 20))
	}
	return nil
}

// stop kills the process group and waits for redis-server to exit.
// s.mu must be held.
func (s *Server) stop() {
	if s.proc == nil {
		return
	}
	s.proc.Kill() // SIGKILL also ends a paused process
	s.proc = nil
}

// waitReady polls addr until the redis-server with process id pid answers,
// the process exits, or startTimeout passes. It returns errPortTaken if a
// different redis-server answers: ours then cannot bind the port.
func waitReady(addr string, pid int, exited <-chan struct{}) error {
	deadline := time.Now().Add(startTimeout)
	for {
		select {
		case <-exited:
			return errors.New("redis-server exited")
		default:
		}
		// Wait for the port to accept connections before speaking Redis to
		// it, so that go-redis does not log every refused dial.
		var got int
		conn, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			conn.Close()
			got, err = processID(addr)
		}
		switch {
		case err == nil && got == pid:
			return nil
		case err == nil:
			return errPortTaken
		case time.Now().After(deadline):
			return fmt.Errorf("no answer within %v: %w", startTimeout, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// processID asks the redis-server at addr for its process id, with a fresh
// connection and no retries.
func processID(addr string) (int, error) {
	c := redis.NewClient(&redis.Options{
		Addr:          addr,
		DialTimeout:   time.Second,
		ReadTimeout:   time.Second,
		WriteTimeout:  time.Second,
		DialerRetries: 1,
		MaxRetries:    -1,
		PoolSize:      1,
	})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	info, err := c.Info(ctx, "server").Result()
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(infoField(info, "process_id"))
}

// withHint adds the installation hint to err unless it already has it.
func withHint(err error) error {
	if strings.Contains(err.Error(), setupHint) {
		return err
	}
	return fmt.Errorf("%w\n(%s, or point REDIS_SERVER at a working binary)", err, setupHint)
}

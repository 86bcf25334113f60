package shed

import "sync"

// callers counts each caller's admitted and queued requests against its
// quota. A caller has an entry only while it has requests in flight, so the
// map holds at most MaxInFlight + QueueSize entries (plus the requests being
// turned away at that moment) however many keys callers send.
type callers struct {
	defaultQuota int64
	quotas       map[string]int64

	mu       sync.Mutex
	inFlight map[string]int64
}

func newCallers(defaultQuota int64, quotas map[string]int64) *callers {
	c := &callers{
		defaultQuota: defaultQuota,
		quotas:       make(map[string]int64, len(quotas)),
		inFlight:     make(map[string]int64),
	}
	for k, v := range quotas {
		c.quotas[k] = v
	}
	return c
}

// quota returns the caller's quota, 0 meaning none. DefaultQuota is a quota
// per API key: keyless requests get one only from Quotas[""].
func (c *callers) quota(caller string) int64 {
	if len(c.quotas) > 0 {
		if q, ok := c.quotas[caller]; ok {
			return q
		}
	}
	if caller == "" {
		return 0
	}
	return c.defaultQuota
}

// acquire counts one more request for caller if that keeps it within quota.
func (c *callers) acquire(caller string, quota int64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.inFlight[caller]
	if n >= quota {
		return false
	}
	c.inFlight[caller] = n + 1
	return true
}

// release counts one request of caller done, dropping the entry at zero.
func (c *callers) release(caller string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := c.inFlight[caller]; n > 1 {
		c.inFlight[caller] = n - 1
		return
	}
	delete(c.inFlight, caller)
}

// size returns the number of callers with requests in flight.
func (c *callers) size() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.inFlight)
}

package skewtest

import (
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"
)

// call makes n concurrent calls to d, each sent with limit.
func call(t *testing.T, d *Dependency, n int, limit int64) {
	t.Helper()
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodGet, d.URL(), nil)
			req.Header.Set("X-Worker", "w"+strconv.Itoa(i))
			req.Header.Set("X-Limit", strconv.FormatInt(limit, 10))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			resp.Body.Close()
		})
	}
	wg.Wait()
}

// TestDependencyFlagsCallsAboveTheirLimit checks the dependency's
// bookkeeping: calls within the limit that admitted them pass, more calls
// in flight than every limit among them, or than the capacity, are
// violations.
func TestDependencyFlagsCallsAboveTheirLimit(t *testing.T) {
	t.Run("within", func(t *testing.T) {
		d := StartDependency(t, 4, 200*time.Millisecond)
		call(t, d, 3, 4)
		if v := d.Violations(); len(v) != 0 {
			t.Errorf("3 calls at limit 4: %v", v)
		}
		if d.Peak() != 3 || d.Total() != 3 || d.Calls("w0") != 1 {
			t.Errorf("peak %d, total %d, calls of w0 %d; want 3, 3, 1", d.Peak(), d.Total(), d.Calls("w0"))
		}
	})
	t.Run("above the limit", func(t *testing.T) {
		d := StartDependency(t, 8, 200*time.Millisecond)
		call(t, d, 4, 2)
		if len(d.Violations()) == 0 {
			t.Error("4 calls at once at limit 2 were not flagged")
		}
	})
	t.Run("above the capacity", func(t *testing.T) {
		d := StartDependency(t, 2, 200*time.Millisecond)
		call(t, d, 3, 5)
		if len(d.Violations()) == 0 {
			t.Error("3 calls at once at capacity 2 were not flagged")
		}
	})
	t.Run("no limit", func(t *testing.T) {
		d := StartDependency(t, 2, 0)
		call(t, d, 1, 0)
		if len(d.Violations()) == 0 {
			t.Error("a call admitted at limit 0 was not flagged")
		}
	})
}

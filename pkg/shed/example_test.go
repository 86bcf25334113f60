package shed_test

import (
	"context"
	"fmt"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/spillway-dev/spillway/pkg/shed"
	"github.com/spillway-dev/spillway/pkg/wire"
)

func Example() {
	s, err := shed.New(shed.Options{
		MaxInFlight:  100,                    // the service's safe concurrency
		QueueSize:    20,                     // a short queue absorbs bursts
		QueueTimeout: 200 * time.Millisecond, // ... but never holds work for long
		DefaultQuota: 25,                     // no one API key takes more than a quarter of the capacity
		Quotas: map[string]int64{
			"nightly-batch": 1, // the batch job: one request at a time
		},
		// Requests without a key are not held to DefaultQuota, only to
		// MaxInFlight; set Quotas[""] to cap them all together.
		Rand: rand.New(rand.NewPCG(1, 2)), // seeded here only to make the output stable
	})
	if err != nil {
		log.Fatal(err)
	}
	handler := s.Middleware(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "rendered")
	}))

	serve := func(key string, headers ...string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodGet, "/render", nil)
		r.Header.Set(wire.DefaultCallerHeader, key)
		for i := 0; i+1 < len(headers); i += 2 {
			r.Header.Set(headers[i], headers[i+1])
		}
		w := httptest.NewRecorder()
		handler.ServeHTTP(w, r)
		return w
	}

	// A first attempt within quota is served.
	fmt.Println(serve("team-a", wire.AttemptHeader, "1").Code)

	// A retry whose caller has already given up is dropped before any work.
	expired := time.Now().Add(-time.Second).UTC().Format(wire.DeadlineLayout)
	fmt.Println(serve("team-a", wire.AttemptHeader, "2", wire.DeadlineHeader, expired).Code)

	// Requests without a key are many clients, not one caller: a second
	// keyless request is served while the first is still running.
	keyless, err := s.Admit(context.Background(), shed.Request{Attempt: 1})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(serve("").Code)
	keyless.Release()

	// While the batch job has its one request in flight, its next one gets
	// 429 and a randomized Retry-After.
	ticket, err := s.Admit(context.Background(), shed.Request{Caller: "nightly-batch", Attempt: 1})
	if err != nil {
		log.Fatal(err)
	}
	w := serve("nightly-batch")
	fmt.Println(w.Code, w.Header().Get("Retry-After") != "")
	ticket.Release()

	// Output:
	// 200
	// 504
	// 200
	// 429 true
}

// manualClock is a clock.Clock the example moves by hand.
type manualClock struct{ now time.Time }

func (c *manualClock) Now() time.Time { return c.now }

// A service that restarts with cold caches turns on the slow start with
// Options.Ramp; only pkg/shed types are needed.
func ExampleRamp() {
	clock := &manualClock{now: time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)}
	s, err := shed.New(shed.Options{
		MaxInFlight: 40,
		Ramp: &shed.Ramp{
			Steps:        []int64{5, 10, 20, 40}, // requests at once, step by step
			StepDuration: time.Minute,            // one step per minute
		},
		Clock: clock, // nil in production: the system clock
	})
	if err != nil {
		log.Fatal(err)
	}
	for range 4 {
		fmt.Println(s.Stats().Limit)
		clock.now = clock.now.Add(time.Minute)
	}
	// Output:
	// 5
	// 10
	// 20
	// 40
}

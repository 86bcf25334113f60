package retry_test

import (
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/spillway-dev/spillway/pkg/retry"
)

func ExampleBackoff_Ceiling() {
	b := retry.Backoff{Base: 5 * time.Second, Max: time.Hour, Jitter: retry.JitterFull}
	for _, attempt := range []int{1, 2, 3, 10, 11, 200} {
		fmt.Println(attempt, b.Ceiling(attempt))
	}
	// Output:
	// 1 5s
	// 2 10s
	// 3 20s
	// 10 42m40s
	// 11 1h0m0s
	// 200 1h0m0s
}

func ExampleBackoff_Delay() {
	b := retry.Backoff{Base: 5 * time.Second, Max: time.Hour, Jitter: retry.JitterFull}
	rnd := rand.New(rand.NewPCG(1, 2)) // seeded by the caller
	d := b.Delay(3, rnd)
	fmt.Println(d >= 0 && d <= b.Ceiling(3))
	// Output: true
}

func ExampleBudget_Allows() {
	// Retries may be at most 20% of calls, with 10 always allowed.
	budget := retry.Budget{Ratio: 0.2, MinRetries: 10, Window: time.Minute}
	fmt.Println(budget.Allows(9, 0))    // under the floor
	fmt.Println(budget.Allows(10, 0))   // floor reached
	fmt.Println(budget.Allows(19, 100)) // under 20% of 100
	fmt.Println(budget.Allows(20, 100)) // exactly at the budget: refused
	// Output:
	// true
	// false
	// true
	// false
}

func ExamplePark() {
	b := retry.Backoff{Base: 5 * time.Second, Max: 300 * time.Second}
	rnd := rand.New(rand.NewPCG(1, 2))
	d := retry.Park(b, rnd)
	fmt.Println(d >= 300*time.Second && d <= 600*time.Second)
	// Output: true
}

package skewtest

import (
	"strings"
	"testing"
)

func TestPinnedNamesACommit(t *testing.T) {
	c, err := Pinned()
	if err != nil {
		t.Fatal(err)
	}
	if len(c) != 40 {
		t.Errorf("Pinned() = %q, want a full commit hash", c)
	}
}

// TestTreeOfAMissingCommitSaysWhy: a commit the clone lacks (a shallow
// clone's case) fails with a message that says what to do.
func TestTreeOfAMissingCommitSaysWhy(t *testing.T) {
	t.Setenv("SPILLWAY_CACHE", t.TempDir())
	_, err := Tree(strings.Repeat("0", 40))
	if err == nil {
		t.Fatal("Tree of a commit that does not exist succeeded")
	}
	for _, want := range []string{"is not in this clone", "git fetch --unshallow", PinFile()} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not say %q: %v", want, err)
		}
	}
}

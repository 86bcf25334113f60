package protocol

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/spillway-dev/spillway/pkg/wire"
)

// Change is an announcement on a dependency's changes channel (Keys.Changes):
// publish sends one whenever it changes the epoch, the state or the limit.
// Pub/sub delivers at most once and only to connected subscribers, so a
// process that batches slots learns of a change from its next pool refresh
// when the message is lost; the announcement only makes it sooner.
type Change struct {
	Epoch int64
	State wire.State
	Limit int64
}

// ParseChange parses an announcement, "<epoch> <state> <limit>".
func ParseChange(payload string) (Change, error) {
	f := strings.Fields(payload)
	if len(f) != 3 {
		return Change{}, fmt.Errorf("change %q must be \"<epoch> <state> <limit>\"", payload)
	}
	epoch, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil {
		return Change{}, fmt.Errorf("change %q has no epoch: %w", payload, err)
	}
	limit, err := strconv.ParseInt(f[2], 10, 64)
	if err != nil {
		return Change{}, fmt.Errorf("change %q has no limit: %w", payload, err)
	}
	return Change{Epoch: epoch, State: wire.State(f[1]), Limit: limit}, nil
}

// SubscribeChanges subscribes to the dependency's changes channel. The
// caller reads the messages (PubSub.Channel) and closes the subscription.
func (c *Client) SubscribeChanges(ctx context.Context) *redis.PubSub {
	return c.rdb.Subscribe(ctx, c.keys.Changes)
}

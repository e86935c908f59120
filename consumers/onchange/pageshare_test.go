package main

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couch"
)

// countingRead is a page read that counts its calls per since and answers page "p<since>".
type countingRead struct {
	mu    sync.Mutex
	calls map[string]int
	gate  chan struct{} // when set, reads wait for it
}

func (c *countingRead) read(ctx context.Context, since string) pageRead {
	c.mu.Lock()
	c.calls[since]++
	c.mu.Unlock()
	if c.gate != nil {
		select {
		case <-c.gate:
		case <-ctx.Done():
			return pageRead{err: ctx.Err()}
		}
	}
	return pageRead{page: couch.ChangesPage{LastSeq: "p" + since}}
}

func (c *countingRead) count(since string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls[since]
}

// The rules of one job at the same seq read each page once between them; a rule asking again
// for a page it was given (starting over) reads it anew; a page of a rule that went its own way
// is its own.
func TestPageShareReadsEachPageOnce(t *testing.T) {
	t.Parallel()
	c := &countingRead{calls: map[string]int{}}
	share := newPageShare(t.Context(), 3, c.read)
	a, b, m := share.reader(), share.reader(), share.reader()
	for _, r := range []*pageReader{a, b, m} {
		assert.Equal(t, "p1", (<-r.page("1")).page.LastSeq)
		assert.Equal(t, "p2", (<-r.page("2")).page.LastSeq)
	}
	assert.Equal(t, 1, c.count("1"), "three rules at one seq read the page three times")
	assert.Equal(t, 1, c.count("2"))

	<-a.page("1") // a starts over
	assert.Equal(t, 2, c.count("1"), "a page asked for again by the rule that had it was not read anew")
	<-b.page("1") // b, too: the fresh read a made is new to b
	assert.Equal(t, 2, c.count("1"))
	<-b.page("1")
	assert.Equal(t, 3, c.count("1"))

	<-m.page("9")
	assert.Equal(t, 1, c.count("9"))
}

// A read runs under the job's context: a rule that stops waiting (its context cancelled, as a
// rule deleted meanwhile) does not fail the page for the others; the job's end does.
func TestPageShareOutlivesTheFirstReader(t *testing.T) {
	t.Parallel()
	c := &countingRead{calls: map[string]int{}, gate: make(chan struct{})}
	job, endJob := context.WithCancel(t.Context())
	share := newPageShare(job, 2, c.read)
	first := share.reader().page("1") // its rule stops waiting for it: nothing cancels the read
	second := share.reader().page("1")
	close(c.gate)
	got := <-second
	require.NoError(t, got.err)
	assert.Equal(t, "p1", got.page.LastSeq)
	assert.Equal(t, "p1", (<-first).page.LastSeq)
	assert.Equal(t, 1, c.count("1"))

	c.gate = make(chan struct{})
	pending := share.reader().page("2")
	endJob()
	assert.True(t, errors.Is((<-pending).err, context.Canceled))
}

// The share keeps pagesKept pages per rule: a page read long before is read again, so a job
// that reads a long history holds a few pages at a time, not the whole history.
func TestPageShareKeepsAFewPages(t *testing.T) {
	t.Parallel()
	var reads atomic.Int64
	share := newPageShare(t.Context(), 1, func(ctx context.Context, since string) pageRead {
		reads.Add(1)
		return pageRead{}
	})
	r1, r2 := share.reader(), share.reader()
	for _, since := range []string{"1", "2", "3", "4"} {
		<-r1.page(since)
	}
	assert.Len(t, share.pages, pagesKept)
	<-r2.page("4")
	assert.Equal(t, int64(4), reads.Load(), "a kept page was read again")
	<-r2.page("1")
	assert.Equal(t, int64(5), reads.Load(), "an old page was kept")
}

package main

import (
	"context"
	"sync"
)

// pagesKept bounds the pages a job's share keeps per rule of the job: the rules that read
// together are at most a page apart (the one acted on and the one read ahead).
const pagesKept = 2

// pageShare lets the rules of one job share their _changes reads. Rules that caught up together
// start at the same seq, and the pages they read (SPIEGEL_BATCH_SIZE rows, include_docs, the
// same for every rule) are the same: each is read once for all of them. A job with a webhook, a
// subject and a mirror rule on a db costs one _changes request per page, not three.
//
// A read runs under the job's context, not the context of the rule that asked first, so a rule
// that stops early (deleted, caught up) does not fail the others' read. A rule asking again for
// a page it was given (it starts over: the db was recreated) reads it anew. The share keeps the
// last pagesKept pages per rule; a rule that fell further behind reads its own.
type pageShare struct {
	ctx  context.Context // the job's
	read func(ctx context.Context, since string) pageRead
	max  int

	mu    sync.Mutex
	pages map[string]*sharedPage // by the seq the page starts after
	order []string               // the keys of pages, oldest first
	reads uint64                 // reads started
}

// sharedPage is one page read, or being read, for the rules of a job.
type sharedPage struct {
	id   uint64        // the read's number in the share
	done chan struct{} // closed once res is set
	res  pageRead
}

// newPageShare returns the share of a job with rules rules, reading pages with read.
func newPageShare(ctx context.Context, rules int, read func(ctx context.Context, since string) pageRead) *pageShare {
	return &pageShare{ctx: ctx, read: read, max: max(1, rules) * pagesKept, pages: map[string]*sharedPage{}}
}

// pageReader is one rule's view of the share: it remembers the pages given to the rule.
type pageReader struct {
	share *pageShare
	given map[string]uint64 // the reads given to the rule, of the pages the share keeps
}

// reader returns a rule's reader.
func (s *pageShare) reader() *pageReader {
	return &pageReader{share: s, given: map[string]uint64{}}
}

// page returns, in the background, the page after since: the one the share holds or is reading,
// or a new read when there is none or this rule was given that very read before.
func (r *pageReader) page(since string) <-chan pageRead {
	s := r.share
	out := make(chan pageRead, 1)
	s.mu.Lock()
	p, ok := s.pages[since]
	if !ok || r.given[since] == p.id {
		s.reads++
		p = &sharedPage{id: s.reads, done: make(chan struct{})}
		if !ok {
			s.order = append(s.order, since)
		}
		s.pages[since] = p
		for len(s.order) > s.max {
			delete(s.pages, s.order[0])
			s.order = s.order[1:]
		}
		go func() {
			p.res = s.read(s.ctx, since)
			close(p.done)
		}()
	}
	r.given[since] = p.id
	if len(r.given) > 2*s.max {
		for k := range r.given {
			if _, kept := s.pages[k]; !kept {
				delete(r.given, k)
			}
		}
	}
	s.mu.Unlock()
	go func() {
		<-p.done
		out <- p.res
	}()
	return out
}

package couch

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// maxLineBytes bounds one feed line (a change with include_docs holds a whole doc). A longer
// line is skipped as malformed.
const maxLineBytes = 64 << 20

// errStalled ends a stream that sent nothing, not even a heartbeat, for twice the heartbeat.
var errStalled = errors.New("feed stalled: no bytes for twice the heartbeat")

// errLineTooLong is reported for a line longer than maxLineBytes.
var errLineTooLong = errors.New("line too long")

// readLines reads r line by line and calls fn with each line that is not blank, trimmed of
// surrounding white space (heartbeats are blank lines). A line longer than maxLen is reported to
// tooLong and skipped. It returns nil at a clean end of r (a final unterminated line is passed
// to fn too), fn's first error, or r's error; a line cut by an error is dropped, never passed on.
func readLines(r io.Reader, maxLen int, fn func(line []byte) error, tooLong func()) error {
	br := bufio.NewReaderSize(r, 64<<10)
	var buf []byte
	skipping := false
	for {
		chunk, err := br.ReadSlice('\n')
		if len(chunk) > 0 && !skipping {
			if len(buf)+len(chunk) > maxLen {
				skipping, buf = true, buf[:0]
				if tooLong != nil {
					tooLong()
				}
			} else {
				buf = append(buf, chunk...)
			}
		}
		switch {
		case err == nil: // a whole line
			if !skipping {
				if line := bytes.TrimSpace(buf); len(line) > 0 {
					if ferr := fn(line); ferr != nil {
						return ferr
					}
				}
			}
			buf, skipping = buf[:0], false
		case errors.Is(err, bufio.ErrBufferFull):
			continue // the line goes on
		case errors.Is(err, io.EOF):
			if !skipping {
				if line := bytes.TrimSpace(buf); len(line) > 0 {
					return fn(line)
				}
			}
			return nil
		default:
			return err
		}
	}
}

// stream is one open feed response with stall detection: the request's context is cancelled
// with errStalled when no byte arrives for the stall window, from before the request is sent
// until the body is closed.
type stream struct {
	body   io.ReadCloser
	cancel context.CancelCauseFunc
	ctx    context.Context
	window time.Duration

	received atomic.Bool // any byte of the body arrived

	mu    sync.Mutex
	timer *time.Timer
}

// openStream sends the request built by build with a context derived from ctx and returns the
// stream once the answer is a success. A status >= 300 returns an *HTTPError. Streams go over
// the feeds' transport, outside the cap on requests.
func (c *Client) openStream(ctx context.Context, window time.Duration, path string,
	build func(ctx context.Context) (*http.Request, error)) (*stream, error) {
	sctx, cancel := context.WithCancelCause(ctx)
	s := &stream{cancel: cancel, ctx: sctx, window: window}
	s.timer = time.AfterFunc(window, func() { cancel(errStalled) })
	req, err := build(sctx)
	if err != nil {
		s.stop()
		return nil, err
	}
	resp, err := c.send(c.streams, req)
	if err != nil {
		s.stop()
		if errors.Is(context.Cause(sctx), errStalled) && ctx.Err() == nil {
			return nil, fmt.Errorf("%s %s: %w", req.Method, path, errStalled)
		}
		return nil, err
	}
	s.body = resp.Body
	s.touch()
	return s, nil
}

// Read implements io.Reader; every byte received restarts the stall window.
func (s *stream) Read(p []byte) (int, error) {
	n, err := s.body.Read(p)
	if n > 0 {
		s.received.Store(true)
		s.touch()
	}
	if err != nil && !errors.Is(err, io.EOF) {
		if cause := context.Cause(s.ctx); errors.Is(cause, errStalled) {
			return n, errStalled
		}
	}
	return n, err
}

func (s *stream) touch() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.timer != nil {
		s.timer.Reset(s.window)
	}
}

// stop releases the stream: the stall timer, the request's context and the body.
func (s *stream) stop() {
	s.mu.Lock()
	if s.timer != nil {
		s.timer.Stop()
		s.timer = nil
	}
	s.mu.Unlock()
	s.cancel(context.Canceled)
	if s.body != nil {
		_ = s.body.Close()
	}
}

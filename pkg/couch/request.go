package couch

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
)

// idempotentAttempts is how often DoIdempotent tries a request.
const idempotentAttempts = 3

// idempotentRetry paces DoIdempotent's attempts.
var idempotentRetry = backoff.Policy{Initial: 200 * time.Millisecond, Max: 2 * time.Second, Multiplier: 2, Jitter: 0.2}

// ResponseDecoder is an answer that decodes itself from the response's content type and body
// (e.g. multipart): an out argument of Do that is not plain JSON.
type ResponseDecoder interface {
	DecodeResponse(contentType string, body io.Reader) error
}

// Send performs req (built with NewRequest) and turns a status >= 300 into an *HTTPError,
// closing the body. On success the caller owns resp.Body. It adds no timeout: req's context
// bounds it (streams of any length, such as attachments, go through it). Every error is redacted.
func (c *Client) Send(req *http.Request) (*http.Response, error) {
	return c.send(c.http, req)
}

// SendStream is Send for a request that may wait, while its connection is held, for another
// request to the same host (an attachment read feeding a multipart write): it goes outside the
// cap of Config.MaxConns, which could otherwise deadlock the two.
func (c *Client) SendStream(req *http.Request) (*http.Response, error) {
	return c.send(c.streams, req)
}

// send is Send over hc: the client's requests or its streams.
func (c *Client) send(hc *http.Client, req *http.Request) (*http.Response, error) {
	path := req.URL.EscapedPath()
	if p := c.base.EscapedPath(); p != "" {
		path = path[min(len(p), len(path)):]
	}
	resp, err := hc.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // its message would repeat method and URL
		}
		return nil, redact(fmt.Errorf("%s %s: %w", req.Method, path, err))
	}
	if resp.StatusCode >= 300 {
		he := readHTTPError(resp, req.Method, path)
		_ = resp.Body.Close()
		return nil, he
	}
	return resp, nil
}

// Do sends one JSON request and decodes the answer into out (nil: discard it; a ResponseDecoder
// decodes itself). path is already escaped (see DBPath); body is nil, an io.Reader or []byte
// sent as is, or any value encoded as JSON. The request ends after Config.RequestTimeout. A
// status >= 300 returns an *HTTPError (see Classify); every error is redacted.
func (c *Client) Do(ctx context.Context, method, path string, query url.Values, body any, out any) error {
	rd, err := encodeBody(body)
	if err != nil {
		return fmt.Errorf("encode body of %s %s: %w", method, path, err)
	}
	return c.do(ctx, method, path, query, rd, out)
}

// DoIdempotent is Do for a request that may be sent more than once (reads, _revs_diff,
// _bulk_get, _bulk_docs with new_edits=false, a PUT with its _rev): it is tried up to three
// times, with a short backoff, when no answer came or the server answered 5xx or 429. body must
// not be an io.Reader.
func (c *Client) DoIdempotent(ctx context.Context, method, path string, query url.Values, body any, out any) error {
	var data []byte
	switch b := body.(type) {
	case nil:
	case io.Reader:
		return fmt.Errorf("%s %s: an idempotent request needs a body it can send again", method, path)
	case []byte:
		data = b
	default:
		var err error
		if data, err = json.Marshal(body); err != nil {
			return fmt.Errorf("encode body of %s %s: %w", method, path, err)
		}
	}
	for attempt := 1; ; attempt++ {
		var rd io.Reader
		if body != nil {
			rd = bytes.NewReader(data)
		}
		err := c.do(ctx, method, path, query, rd, out)
		if err == nil || attempt >= idempotentAttempts || !retryable(ctx, err) {
			return err
		}
		if backoff.Sleep(ctx, idempotentRetry.Delay(attempt)) != nil {
			return err
		}
	}
}

func (c *Client) do(ctx context.Context, method, path string, query url.Values, body io.Reader, out any) error {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	req, err := c.NewRequest(ctx, method, path, query, body)
	if err != nil {
		return err
	}
	resp, err := c.Send(req)
	if err != nil {
		return err
	}
	defer func() {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		_ = resp.Body.Close()
	}()
	switch o := out.(type) {
	case nil:
		return nil
	case ResponseDecoder:
		err = o.DecodeResponse(resp.Header.Get("Content-Type"), resp.Body)
	default:
		err = json.NewDecoder(resp.Body).Decode(out)
	}
	if err != nil {
		return redact(fmt.Errorf("decode answer of %s %s: %w", method, path, err))
	}
	return nil
}

// maxReplicateAnswer bounds the bytes read of one _replicate answer.
const maxReplicateAnswer = 4 << 20

// Replicate sends body (a _replicate request, which holds credentials: it is never logged) to
// POST /_replicate and returns the server's answer. Only ctx bounds it: a one-shot replication
// takes as long as it takes (the caller sets the deadline), holding its connection all along:
// it goes over the streams' transport (SendStream), so long replications do not take the
// capped connections of short requests; their number is the caller's concurrency. A refusal is
// an *HTTPError (see Classify); no error holds the body.
func (c *Client) Replicate(ctx context.Context, body []byte) ([]byte, error) {
	req, err := c.NewRequest(ctx, http.MethodPost, "/_replicate", nil, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	resp, err := c.SendStream(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxReplicateAnswer))
	if err != nil {
		return nil, redact(fmt.Errorf("read answer of POST /_replicate: %w", err))
	}
	return answer, nil
}

func encodeBody(body any) (io.Reader, error) {
	switch b := body.(type) {
	case nil:
		return nil, nil
	case io.Reader:
		return b, nil
	case []byte:
		return bytes.NewReader(b), nil
	case json.RawMessage:
		return bytes.NewReader(b), nil
	default:
		data, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		return bytes.NewReader(data), nil
	}
}

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
	"strconv"
	"time"
)

// Change is one row of a db's _changes feed.
type Change struct {
	Seq     string // opaque
	ID      string
	Deleted bool
	Revs    []string        // changes[].rev: the leaf revs (all of them with AllDocs)
	Doc     json.RawMessage // the doc, when IncludeDocs; nil otherwise
}

// ChangesOptions select the rows and their content.
type ChangesOptions struct {
	Since       string        // "" = the beginning, "now", or an opaque seq
	Limit       int           // rows per page (Changes only); 0 = no limit
	IncludeDocs bool          // include_docs=true
	AllDocs     bool          // style=all_docs: every leaf rev, not only the winner
	Conflicts   bool          // conflicts=true (with IncludeDocs)
	Filter      string        // a filter (e.g. "ddoc/name"); ignored when DocIDs is set
	Params      url.Values    // extra query parameters, e.g. for Filter
	DocIDs      []string      // only these docs: filter=_doc_ids, sent with POST
	Heartbeat   time.Duration // FollowChanges only; 0 = 10s
}

// ChangesPage is one answer of a normal _changes feed.
type ChangesPage struct {
	Results []Change
	LastSeq string // where the next page starts (pass it as Since)
	Pending int64  // rows left after this page (CouchDB; 0 where the server does not say)
}

// changeRow is a row of _changes as sent, or a continuous feed's last line.
type changeRow struct {
	Seq     Seq    `json:"seq"`
	ID      string `json:"id"`
	Deleted bool   `json:"deleted"`
	Changes []struct {
		Rev string `json:"rev"`
	} `json:"changes"`
	Doc     json.RawMessage `json:"doc"`
	LastSeq *Seq            `json:"last_seq"`
	Error   string          `json:"error"`
	Reason  string          `json:"reason"`
}

func (r changeRow) change() Change {
	c := Change{Seq: string(r.Seq), ID: r.ID, Deleted: r.Deleted}
	for _, ch := range r.Changes {
		c.Revs = append(c.Revs, ch.Rev)
	}
	if len(r.Doc) > 0 && string(r.Doc) != "null" {
		c.Doc = r.Doc
	}
	return c
}

// parseChangeLine decodes one line of a continuous _changes feed (a lineDecoder).
func parseChangeLine(line []byte) (Change, string, bool, error) {
	var r changeRow
	if err := json.Unmarshal(line, &r); err != nil {
		return Change{}, "", false, fmt.Errorf("decode change: %w", err)
	}
	if r.Error != "" {
		return Change{}, "", false, &feedLineError{name: r.Error, reason: r.Reason}
	}
	if r.ID == "" {
		if r.LastSeq != nil {
			return Change{}, string(*r.LastSeq), false, nil
		}
		return Change{}, "", false, errors.New("change has no id")
	}
	if r.Seq == "" {
		return Change{}, "", false, errors.New("change has no seq")
	}
	c := r.change()
	return c, c.Seq, true, nil
}

// changesRequest builds the _changes request of db for feed ("normal" or "continuous").
func (c *Client) changesRequest(ctx context.Context, db string, opt ChangesOptions, feed, since string) (*http.Request, error) {
	q := url.Values{}
	for k, vs := range opt.Params {
		q[k] = append([]string(nil), vs...)
	}
	q.Set("feed", feed)
	if since != "" {
		q.Set("since", since)
	}
	if opt.Limit > 0 && feed == "normal" {
		q.Set("limit", strconv.Itoa(opt.Limit))
	}
	if opt.IncludeDocs {
		q.Set("include_docs", "true")
	}
	if opt.AllDocs {
		q.Set("style", "all_docs")
	}
	if opt.Conflicts {
		q.Set("conflicts", "true")
	}
	if feed == "continuous" {
		q.Set("heartbeat", heartbeatMillis(opt.Heartbeat))
	}
	method := http.MethodGet
	var body io.Reader
	switch {
	case len(opt.DocIDs) > 0:
		q.Set("filter", "_doc_ids")
		data, err := json.Marshal(map[string][]string{"doc_ids": opt.DocIDs})
		if err != nil {
			return nil, fmt.Errorf("encode doc_ids: %w", err)
		}
		method, body = http.MethodPost, bytes.NewReader(data)
	case opt.Filter != "":
		q.Set("filter", opt.Filter)
	}
	return c.NewRequest(ctx, method, c.DBPath(db)+"/_changes", q, body)
}

func heartbeatMillis(d time.Duration) string {
	if d <= 0 {
		d = DefaultHeartbeat
	}
	return strconv.FormatInt(max(d.Milliseconds(), 1), 10)
}

// Changes reads one page of db's changes (feed=normal) after opt.Since, at most opt.Limit rows.
// A missing db returns an error matching ErrNotFound. The request ends after
// Config.RequestTimeout.
func (c *Client) Changes(ctx context.Context, db string, opt ChangesOptions) (ChangesPage, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	req, err := c.changesRequest(ctx, db, opt, "normal", opt.Since)
	if err != nil {
		return ChangesPage{}, err
	}
	resp, err := c.Send(req)
	if err != nil {
		return ChangesPage{}, fmt.Errorf("read changes of %s: %w", db, err)
	}
	defer resp.Body.Close()
	var body struct {
		Results []changeRow `json:"results"`
		LastSeq Seq         `json:"last_seq"`
		Pending int64       `json:"pending"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return ChangesPage{}, redact(fmt.Errorf("decode changes of %s: %w", db, err))
	}
	page := ChangesPage{LastSeq: string(body.LastSeq), Pending: body.Pending, Results: make([]Change, 0, len(body.Results))}
	for _, r := range body.Results {
		page.Results = append(page.Results, r.change())
	}
	return page, nil
}

// ChangedSince reports whether db has a change after since: one _changes read of at most one
// row. On a cluster the read starts from the shard copies since names (or, for a copy that is
// down, from where CouchDB maps its seq on another copy, which may read a change again: true).
// A missing db returns an error matching ErrNotFound.
func (c *Client) ChangedSince(ctx context.Context, db, since string) (bool, error) {
	page, err := c.Changes(ctx, db, ChangesOptions{Since: since, Limit: 1})
	if err != nil {
		return false, err
	}
	return len(page.Results) > 0, nil
}

// FollowChanges follows db's continuous _changes from opt.Since ("" = the beginning, "now" =
// only new changes) and calls emit for each change, one at a time, in feed order. It reconnects
// forever (capped, jittered backoff; a missing db is retried too), resuming from the seq of the
// last change emitted, so emit sees every change at least once and may see some twice. A
// stream silent for twice opt.Heartbeat (default 10s) is torn down and reopened. It returns
// ctx.Err() when ctx ends, emit's error unchanged, or a permanent error (400, 401, 403)
// wrapping the *HTTPError. opt.Limit is ignored.
func (c *Client) FollowChanges(ctx context.Context, db string, opt ChangesOptions, emit func(Change) error) error {
	return c.changesFollower(db, opt).run(ctx, opt.Since, emit)
}

// changesFollower follows db's continuous _changes with opt.
func (c *Client) changesFollower(db string, opt ChangesOptions) *follower[Change] {
	return &follower[Change]{
		c:         c,
		log:       c.log.WithField("db", db),
		name:      "_changes of " + db,
		path:      c.DBPath(db) + "/_changes",
		heartbeat: opt.Heartbeat,
		request: func(ctx context.Context, feed, since string) (*http.Request, error) {
			return c.changesRequest(ctx, db, opt, feed, since)
		},
		decode: parseChangeLine,
	}
}

// WatchChanges opens one continuous _changes connection of db from now (changes made before it
// is open are not seen) and calls connected once the server has answered, then emit for each
// change, in feed order. It never reconnects: it returns when the connection ends — ctx.Err(),
// emit's error unchanged, the server's refusal (an *HTTPError; ErrNotFound for a missing db), a
// stall (no byte, heartbeats included, for twice opt.Heartbeat), the server ending the feed (an
// error too: the caller cannot tell what it missed) — so the caller knows exactly which span of
// time the changes it saw cover. opt.Since and opt.Limit are ignored.
func (c *Client) WatchChanges(ctx context.Context, db string, opt ChangesOptions, connected func(), emit func(Change) error) error {
	f := c.changesFollower(db, opt)
	f.onState = func(err error) {
		if err == nil && connected != nil {
			connected()
		}
	}
	since := SinceNow
	var st connState
	err := f.once(ctx, &since, &st, emit)
	if ctxErr := ctx.Err(); ctxErr != nil {
		return ctxErr
	}
	var ee *emitError
	if errors.As(err, &ee) {
		return ee.err
	}
	if err == nil {
		return fmt.Errorf("%s: the server ended the feed", f.name)
	}
	return err
}

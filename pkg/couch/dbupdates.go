package couch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// Names of the db-updates sources.
const (
	SourceAuto          = "auto"
	SourceDBUpdates     = "db_updates"
	SourceGlobalChanges = "global_changes"
	SourcePoll          = "poll"
)

// Types of db events, as CouchDB's _db_updates names them.
const (
	EventCreated = "created"
	EventUpdated = "updated"
	EventDeleted = "deleted"
)

// DBEvent is one db-level event: a db was created, written to, or deleted.
type DBEvent struct {
	DB   string
	Type string // EventCreated, EventUpdated or EventDeleted
	Seq  string // opaque feed position after this event; PollSeq for the poll source
}

// UpdatesFeed is a source of db events.
type UpdatesFeed interface {
	// Run emits events from since ("" = beginning, "now" = only new ones, or a seq from a
	// previous Seq) in feed order, one at a time, until ctx ends. It reconnects by itself (capped
	// jittered backoff, resume from the last seq emitted) and only returns ctx.Err(), emit's
	// error, or a permanent error (400, 401, 403). Events are delivered at least once.
	Run(ctx context.Context, since string, emit func(DBEvent) error) error
	// Source names the source: "db_updates", "global_changes" or "poll".
	Source() string
}

// FeedOptions tune the feeds; zero values take the defaults.
type FeedOptions struct {
	Heartbeat    time.Duration // continuous feeds: default 10s
	PollInterval time.Duration // poll: pause between rounds, default 2s
	PollBatch    int           // poll: dbs per _dbs_info request, default (and at most) 100
	// Match, when set, limits the events to the dbs for which it returns true (every source),
	// and the poll source reads the info of those dbs only. It must be safe for concurrent use
	// and fast: it runs for every db of every round and every feed line.
	Match func(db string) bool
	// OnState, when set, is told how the feed fares: nil each time a connection is established
	// (continuous feeds) or a round succeeds (poll), the error each time one fails, including
	// the permanent error that ends Run. Feeds reconnect by themselves, so this is the only
	// place a caller learns that the feed is interrupted. It must not block.
	OnState func(err error)
}

func (o FeedOptions) withDefaults() FeedOptions {
	if o.Heartbeat <= 0 {
		o.Heartbeat = DefaultHeartbeat
	}
	if o.PollInterval <= 0 {
		o.PollInterval = 2 * time.Second
	}
	if o.PollBatch <= 0 || o.PollBatch > dbsInfoBatch {
		o.PollBatch = dbsInfoBatch
	}
	return o
}

// NewUpdatesFeed returns the feed of source: "db_updates", "global_changes", "poll", or "auto"
// (also ""), which probes the server and picks the first of these it supports. Probing returns
// a permanent error when the credentials are refused (401/403), and any other unexpected answer
// as an error the caller may retry. An unknown source is an error listing the valid ones.
func (c *Client) NewUpdatesFeed(ctx context.Context, source string, opt FeedOptions) (UpdatesFeed, error) {
	opt = opt.withDefaults()
	switch source {
	case SourceDBUpdates:
		return c.dbUpdatesFeed(opt), nil
	case SourceGlobalChanges:
		return c.globalChangesFeed(opt), nil
	case SourcePoll:
		return &pollFeed{c: c, log: c.log.WithField("source", SourcePoll), opt: opt}, nil
	case SourceAuto, "":
		chosen, err := c.probeSource(ctx)
		if err != nil {
			return nil, err
		}
		c.log.WithField("source", chosen).Info("db updates source chosen")
		return c.NewUpdatesFeed(ctx, chosen, opt)
	default:
		return nil, fmt.Errorf("unknown db updates source %q: want one of auto, db_updates, global_changes, poll", source)
	}
}

// probeSource returns the first source the server supports.
func (c *Client) probeSource(ctx context.Context) (string, error) {
	probes := []struct {
		source string
		path   string
		query  url.Values
	}{
		{SourceDBUpdates, "/_db_updates", url.Values{"feed": {"normal"}, "limit": {"1"}}},
		{SourceGlobalChanges, "/_global_changes/_changes", url.Values{"feed": {"normal"}, "limit": {"1"}}},
	}
	for _, p := range probes {
		err := c.Do(ctx, http.MethodGet, p.path, p.query, nil, nil)
		if err == nil {
			return p.source, nil
		}
		var he *HTTPError
		if !errors.As(err, &he) {
			return "", fmt.Errorf("probe %s: %w", p.path, err)
		}
		switch {
		case Classify(he) == Auth:
			return "", fmt.Errorf("probe %s: the credentials in %s are refused; the feeds need a server admin: %w",
				p.path, c.redacted, err)
		case he.Status == http.StatusBadRequest, he.Status == http.StatusNotFound,
			he.Status == http.StatusMethodNotAllowed, he.Status == http.StatusNotImplemented:
			c.log.WithField("source", p.source).WithError(err).Debug("db updates source not supported")
		default:
			return "", fmt.Errorf("probe %s: %w", p.path, err)
		}
	}
	return SourcePoll, nil
}

// streamFeed is an UpdatesFeed over a continuous feed.
type streamFeed struct {
	source string
	f      *follower[DBEvent]
	match  func(db string) bool
}

func (s *streamFeed) Run(ctx context.Context, since string, emit func(DBEvent) error) error {
	if s.match == nil {
		return s.f.run(ctx, since, emit)
	}
	return s.f.run(ctx, since, func(ev DBEvent) error {
		if !s.match(ev.DB) {
			return nil
		}
		return emit(ev)
	})
}

func (s *streamFeed) Source() string { return s.source }

func (c *Client) dbUpdatesFeed(opt FeedOptions) *streamFeed {
	const path = "/_db_updates"
	return &streamFeed{source: SourceDBUpdates, match: opt.Match, f: &follower[DBEvent]{
		c: c, log: c.log.WithField("source", SourceDBUpdates), name: "_db_updates", path: path,
		heartbeat: opt.Heartbeat, onState: opt.OnState,
		request: func(ctx context.Context, feed, since string) (*http.Request, error) {
			return c.NewRequest(ctx, http.MethodGet, path, feedQuery(feed, since, opt.Heartbeat), nil)
		},
		decode: parseDBUpdateLine,
	}}
}

func (c *Client) globalChangesFeed(opt FeedOptions) *streamFeed {
	const path = "/_global_changes/_changes"
	return &streamFeed{source: SourceGlobalChanges, match: opt.Match, f: &follower[DBEvent]{
		c: c, log: c.log.WithField("source", SourceGlobalChanges), name: "_global_changes", path: path,
		heartbeat: opt.Heartbeat, onState: opt.OnState,
		request: func(ctx context.Context, feed, since string) (*http.Request, error) {
			return c.NewRequest(ctx, http.MethodGet, path, feedQuery(feed, since, opt.Heartbeat), nil)
		},
		decode: parseGlobalChangesLine,
	}}
}

func feedQuery(feed, since string, heartbeat time.Duration) url.Values {
	q := url.Values{"feed": {feed}}
	if since != "" {
		q.Set("since", since)
	}
	if feed == "continuous" {
		q.Set("heartbeat", heartbeatMillis(heartbeat))
	}
	return q
}

// normalizeType maps a feed's event type to an Event* type: any type other than created and
// deleted (e.g. ddoc_updated) means the db changed, so it becomes updated.
func normalizeType(t string) string {
	switch t {
	case EventCreated, EventDeleted, EventUpdated:
		return t
	default:
		return EventUpdated
	}
}

// parseDBUpdateLine decodes one line of _db_updates: {"db_name","type","seq"}, or the final
// {"last_seq":...} (no event, only a position).
func parseDBUpdateLine(line []byte) (DBEvent, string, bool, error) {
	var l struct {
		DBName  string `json:"db_name"`
		Type    string `json:"type"`
		Seq     Seq    `json:"seq"`
		LastSeq *Seq   `json:"last_seq"`
		Error   string `json:"error"`
		Reason  string `json:"reason"`
	}
	if err := json.Unmarshal(line, &l); err != nil {
		return DBEvent{}, "", false, fmt.Errorf("decode db update: %w", err)
	}
	if l.Error != "" {
		return DBEvent{}, "", false, &feedLineError{name: l.Error, reason: l.Reason}
	}
	if l.DBName == "" {
		if l.LastSeq != nil {
			return DBEvent{}, string(*l.LastSeq), false, nil
		}
		return DBEvent{}, "", false, errors.New("db update has no db_name")
	}
	if l.Type == "" {
		return DBEvent{}, "", false, errors.New("db update has no type")
	}
	ev := DBEvent{DB: l.DBName, Type: normalizeType(l.Type), Seq: string(l.Seq)}
	return ev, ev.Seq, true, nil
}

// parseGlobalChangesLine decodes one line of _global_changes/_changes: {"seq","id":"<type>:<db>"},
// or the final {"last_seq":...}. The id is split at its first ':' (db names cannot hold one).
// Design docs of that db are passed over (position only).
func parseGlobalChangesLine(line []byte) (DBEvent, string, bool, error) {
	var l struct {
		Seq     Seq    `json:"seq"`
		ID      string `json:"id"`
		LastSeq *Seq   `json:"last_seq"`
		Error   string `json:"error"`
		Reason  string `json:"reason"`
	}
	if err := json.Unmarshal(line, &l); err != nil {
		return DBEvent{}, "", false, fmt.Errorf("decode global change: %w", err)
	}
	if l.Error != "" {
		return DBEvent{}, "", false, &feedLineError{name: l.Error, reason: l.Reason}
	}
	if l.ID == "" {
		if l.LastSeq != nil {
			return DBEvent{}, string(*l.LastSeq), false, nil
		}
		return DBEvent{}, "", false, errors.New("global change has no id")
	}
	if strings.HasPrefix(l.ID, "_design/") {
		return DBEvent{}, string(l.Seq), false, nil
	}
	typ, db, found := strings.Cut(l.ID, ":")
	if !found || typ == "" || db == "" {
		return DBEvent{}, "", false, fmt.Errorf("global change id %q is not <type>:<db>", truncate([]byte(l.ID), 100))
	}
	ev := DBEvent{DB: db, Type: normalizeType(typ), Seq: string(l.Seq)}
	return ev, ev.Seq, true, nil
}

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/replicate"
)

// nativeEngine replicates in this process with pkg/replicate (rules with "engine": "native",
// or every rule with SPIEGEL_REPLICATION_ENGINE=native). Checkpoints live in _local docs on
// source and target as with CouchDB's replicator, so an incremental run of a db with a few new
// docs costs a handful of requests, and a killed run resumes from its last checkpoint.
type nativeEngine struct {
	hc  *http.Client // shared by every run, so connections are reused
	shc *http.Client // attachment reads, outside hc's cap on connections (see replicate.Options)
	log logrus.FieldLogger
	// checkpoints caches the replications' checkpoints between runs (nil: none)
	checkpoints *replicate.CheckpointCache
	// checkpointDefer batches the checkpoints of a burst of small runs of one replication
	// (replicate.Options.CheckpointDefer).
	checkpointDefer time.Duration
	// fence orders the checkpoint writes of a replication's runs (nil: none; see kvFence)
	fence replicate.Fence
}

// nativeCheckpointDefer is the checkpoint batching window of the consumer's native runs: a small
// run (one batch of changes) less than 5 minutes after its replication's last checkpoint leaves
// its checkpoint pair to a later run, and the next run starts from where it got to (kept in the
// process's cache). CouchDB's own replicator checkpoints every 30 s while it runs; here a run is
// short and most dbs are written now and then, so with 30 s nearly every run of a db written
// less often than that (at 10,000 dbs: every 100 s) wrote two _local docs. What a longer window
// costs: a killed process, or an entry dropped from the cache, makes the next run re-read up to
// 5 minutes of the db's changes, which the target already holds (one _revs_diff finds them).
const nativeCheckpointDefer = 5 * time.Minute

// nativeCheckpointDeferChanges goes further for a db written now and then: a small run after an
// older checkpoint still leaves it while fewer than 100 changes were read past it
// (replicate.Options.CheckpointDeferChanges). With the time window alone, a db written every
// few minutes paid its two _local writes for nearly every change (1.19 per written doc at
// 10,000 dbs). What it costs: a run without the cached progress (a restarted process) re-reads
// up to 100 changes that the target holds, in one page.
const nativeCheckpointDeferChanges = 100

// The consumer's native runs cache their replications' checkpoints for up to an hour (longer
// than the checkpoint window, so that a deferred run's progress outlives it), for up to 10,000
// replications: a run with a cached entry reads no checkpoint but the target's (the
// verification), where a run without one reads both; and a target deleted and recreated behind
// the cache's back is noticed by the next run. An entry holds a few KB (the size bounds the
// memory); with 10 minutes, a db written less often than that read both checkpoints each time.
const (
	nativeCheckpointCacheAge  = time.Hour
	nativeCheckpointCacheSize = 10000
)

// nativeOp names the native engine in its errors.
const nativeOp = "native replication"

// nativeOptions reads a _replicate body into the native engine's options. Besides source and
// target it understands the fields below; others (e.g. CouchDB's http_connections or
// use_checkpoints) tune CouchDB's replicator, have no meaning here and are ignored.
//
//   - create_target: bool
//   - filter, query_params, doc_ids, selector: as for POST /_replicate
//   - worker_batch_size: changes per batch; worker_processes: batches in flight
//   - checkpoint_interval: milliseconds between checkpoints
//
// since_seq is refused: the engine always starts from its checkpoint.
func nativeOptions(body map[string]any) (replicate.Options, error) {
	var opt replicate.Options
	bad := func(field, why string) (replicate.Options, error) {
		return opt, &replicateError{Op: nativeOp, Status: http.StatusBadRequest, ErrorName: "bad_request",
			Reason: fmt.Sprintf("rule field %s: %s", field, why)}
	}
	var ok bool
	if opt.Source, ok = body["source"].(string); !ok {
		return bad("source", "must be a URL string")
	}
	if opt.Target, ok = body["target"].(string); !ok {
		return bad("target", "must be a URL string")
	}
	if v, present := body["create_target"]; present {
		if opt.CreateTarget, ok = v.(bool); !ok {
			return bad("create_target", "must be true or false")
		}
	}
	if v, present := body["filter"]; present {
		if opt.Filter, ok = v.(string); !ok {
			return bad("filter", "must be a string")
		}
	}
	if v, present := body["query_params"]; present {
		if opt.QueryParams, ok = v.(map[string]any); !ok {
			return bad("query_params", "must be an object")
		}
	}
	if v, present := body["doc_ids"]; present {
		list, isList := v.([]any)
		if !isList {
			return bad("doc_ids", "must be an array of strings")
		}
		for _, id := range list {
			s, isStr := id.(string)
			if !isStr {
				return bad("doc_ids", "must be an array of strings")
			}
			opt.DocIDs = append(opt.DocIDs, s)
		}
	}
	if v, present := body["selector"]; present {
		if opt.Selector, ok = v.(map[string]any); !ok {
			return bad("selector", "must be an object")
		}
	}
	if _, present := body["since_seq"]; present {
		return bad("since_seq", "not supported: the engine starts from its checkpoint")
	}
	if err := opt.Validate(); err != nil {
		return opt, &replicateError{Op: nativeOp, Status: http.StatusBadRequest, ErrorName: "bad_request", Reason: err.Error()}
	}
	for field, dst := range map[string]*int{"worker_batch_size": &opt.BatchSize, "worker_processes": &opt.Workers} {
		if v, present := body[field]; present {
			n, isNum := positiveInt(v)
			if !isNum {
				return bad(field, "must be a positive integer")
			}
			*dst = n
		}
	}
	if v, present := body["checkpoint_interval"]; present {
		ms, isNum := positiveInt(v)
		if !isNum {
			return bad("checkpoint_interval", "must be a positive number of milliseconds")
		}
		opt.CheckpointInterval = time.Duration(ms) * time.Millisecond
	}
	return opt, nil
}

// positiveInt reads a JSON number (float64 from encoding/json, or an int) that is a positive
// integer.
func positiveInt(v any) (int, bool) {
	switch n := v.(type) {
	case float64:
		if n >= 1 && n == float64(int(n)) {
			return int(n), true
		}
	case int:
		if n >= 1 {
			return n, true
		}
	case json.Number:
		if i, err := n.Int64(); err == nil && i >= 1 {
			return int(i), true
		}
	}
	return 0, false
}

// errSourceMissing is the native engine's answer when the source db does not exist: not a
// failure to retry (see replicator.missingSource); its next creation and write runs the rule
// again.
var errSourceMissing = errors.New("the source db does not exist")

// Replicate runs one native replication of body's source to its target. Errors are mapped to
// what classify understands: a missing source or target is db_not_found, refused credentials
// are permanent, a bad rule field is a 400; anything else (network, 5xx, timeouts) is
// transient. No returned error holds a password.
func (e nativeEngine) Replicate(ctx context.Context, body map[string]any, secrets []string) (result, error) {
	opt, err := nativeOptions(body)
	if err != nil {
		return result{}, err
	}
	opt.HTTPClient, opt.StreamHTTPClient, opt.CheckpointDefer, opt.Checkpoints, opt.Fence = e.hc, e.shc, e.checkpointDefer, e.checkpoints, e.fence
	opt.CheckpointDeferChanges = nativeCheckpointDeferChanges
	res, err := replicate.Run(ctx, opt, e.log)
	if err == nil {
		return result{DocsWritten: res.DocsWritten, DocWriteFailures: res.DocWriteFailures,
			NoChanges: res.NoChanges, SessionID: res.SessionID, FeedEnd: res.FeedEnd}, nil
	}
	msg := scrub(err.Error(), secrets)
	var he *couch.HTTPError
	switch {
	case errors.Is(err, replicate.ErrSourceNotFound):
		return result{}, fmt.Errorf("%w: %s", errSourceMissing, msg)
	case errors.Is(err, replicate.ErrTargetNotFound):
		return result{}, &replicateError{Op: nativeOp, Status: http.StatusNotFound, ErrorName: "db_not_found", Reason: msg}
	case errors.As(err, &he) && couch.Classify(he) != couch.Transient:
		return result{}, &replicateError{Op: nativeOp, Status: he.Status, ErrorName: he.ErrorName, Reason: msg}
	}
	return result{}, &scrubbedError{msg: msg, err: err}
}

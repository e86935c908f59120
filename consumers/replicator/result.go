package main

import (
	"encoding/json"
	"errors"
	"fmt"
)

// result is what one successful one-shot replication reports, reduced to what the service logs
// and counts. Both server dialects decode into it.
type result struct {
	// DocsWritten is the number of docs this run wrote to the target (0 for "no changes").
	DocsWritten int64
	// DocWriteFailures counts docs the target refused (e.g. a validate_doc_update); CouchDB still
	// says ok, and retrying would not change the answer.
	DocWriteFailures int64
	// NoChanges is true when the server said there was nothing to replicate.
	NoChanges bool
	// SessionID is CouchDB's session id ("" on PouchDB Server).
	SessionID string
	// FeedEnd is where the run found the end of the source's changes feed, every change before
	// it replicated (the native engine; "" for the server's _replicate, whose caller vouches
	// for the update_seq it read before).
	FeedEnd string
}

// errNotOK is returned by parseResult for a 2xx answer that does not say ok.
var errNotOK = errors.New("replication answer does not say ok")

// resultJSON covers both shapes of a successful POST /_replicate:
//
//   - CouchDB 3: {"ok":true,"session_id":..,"source_last_seq":..,"replication_id_version":4,
//     "history":[{"session_id":..,"docs_written":N,...}, older sessions...]}, or the same with
//     "no_changes":true, where history[0] is an earlier session (its counts are not this run's).
//     Since CouchDB 2 (replication id version 4) the counts are cumulative: a session's own
//     count is history[0]'s minus history[1]'s.
//   - PouchDB Server: {"ok":true,"docs_read":..,"docs_written":N,"doc_write_failures":..,
//     "status":"complete",...} (its history is of no use).
type resultJSON struct {
	OK               *bool        `json:"ok"`
	NoChanges        bool         `json:"no_changes"`
	SessionID        string       `json:"session_id"`
	DocsWritten      *json.Number `json:"docs_written"`
	DocWriteFailures *json.Number `json:"doc_write_failures"`
	Status           string       `json:"status"`
	RepIDVersion     int          `json:"replication_id_version"`
	History          []struct {
		SessionID        string      `json:"session_id"`
		DocsWritten      json.Number `json:"docs_written"`
		DocWriteFailures json.Number `json:"doc_write_failures"`
	} `json:"history"`
}

// parseResult decodes the body of a 2xx answer of POST /_replicate. An answer that is not JSON,
// or lacks "ok": true, is an error wrapping errNotOK (or the decode error): the caller treats it
// as transient, because a server that answered 2xx without saying ok is not refusing the rule.
func parseResult(body []byte) (result, error) {
	var j resultJSON
	if err := json.Unmarshal(body, &j); err != nil {
		return result{}, fmt.Errorf("decode replication answer: %w", err)
	}
	if j.OK == nil || !*j.OK {
		return result{}, fmt.Errorf("%w (status %q)", errNotOK, j.Status)
	}
	if j.Status != "" && j.Status != "complete" {
		return result{}, fmt.Errorf("%w: status %q", errNotOK, j.Status)
	}
	r := result{NoChanges: j.NoChanges, SessionID: j.SessionID}
	switch {
	case j.NoChanges:
		// history[0] is the previous session: nothing was written now.
	case j.DocsWritten != nil: // PouchDB Server: counts at the top level
		r.DocsWritten = number(*j.DocsWritten)
		if j.DocWriteFailures != nil {
			r.DocWriteFailures = number(*j.DocWriteFailures)
		}
	case len(j.History) > 0 && (j.SessionID == "" || j.History[0].SessionID == j.SessionID):
		r.DocsWritten = number(j.History[0].DocsWritten)
		r.DocWriteFailures = number(j.History[0].DocWriteFailures)
		if j.RepIDVersion >= 4 && len(j.History) > 1 {
			// CouchDB 2+ carries the counts over from the previous checkpoint: history[0] holds
			// the totals of every session, history[1] those before this one.
			prev := j.History[1]
			r.DocsWritten = max(r.DocsWritten-number(prev.DocsWritten), 0)
			r.DocWriteFailures = max(r.DocWriteFailures-number(prev.DocWriteFailures), 0)
		}
	}
	return r, nil
}

// number reads a JSON count; anything that is not a non-negative integer counts as 0.
func number(n json.Number) int64 {
	v, err := n.Int64()
	if err != nil || v < 0 {
		return 0
	}
	return v
}

package couchtest

import (
	"net/http"
	"net/url"
	"strings"
)

// methodCopy is CouchDB's COPY method (copies a doc within a db).
const methodCopy = "COPY"

// dbWrite is a db change that a request makes when it succeeds.
type dbWrite struct {
	db  string // unescaped
	typ string // updateCreated, updateUpdated or updateDeleted
}

// systemDBs are the db names starting with '_' that a request path may name. Every other
// top-level '_' path (/_session, /_replicate, /_all_dbs, …) is an endpoint, not a db.
var systemDBs = map[string]bool{"_users": true, "_replicator": true, "_global_changes": true}

// dbWriteEndpoints are the '_' endpoints under /{db} that write docs. The others (_all_docs,
// _find, _changes, _security, _compact, …) do not change the db's update_seq, and CouchDB 3 has
// no _db_updates event for them.
var dbWriteEndpoints = map[string]bool{"_bulk_docs": true, "_purge": true, "_index": true}

// classifyWrite reports which db change a request of method on escapedPath (relative to the
// server root) makes when it succeeds: PUT /{db} creates, DELETE /{db} deletes, and PUT, POST,
// DELETE or COPY of a doc, design doc, attachment, _bulk_docs, _purge or _index updates.
// Reads, /{db}/_local/… (local docs bump no seq), other '_' endpoints and unknown methods are no
// change. The db segment is unescaped (%2F, %2B; '+' stays '+').
func classifyWrite(method, escapedPath string) (dbWrite, bool) {
	switch method {
	case http.MethodPut, http.MethodPost, http.MethodDelete, methodCopy:
	default:
		return dbWrite{}, false
	}
	segs := strings.Split(strings.TrimPrefix(escapedPath, "/"), "/")
	if len(segs) > 1 && segs[len(segs)-1] == "" {
		segs = segs[:len(segs)-1] // "/db/" is "/db"
	}
	db, err := url.PathUnescape(segs[0])
	if err != nil || db == "" || strings.HasPrefix(db, "_") && !systemDBs[db] {
		return dbWrite{}, false
	}
	if len(segs) == 1 {
		switch method {
		case http.MethodPut:
			return dbWrite{db: db, typ: updateCreated}, true
		case http.MethodDelete:
			return dbWrite{db: db, typ: updateDeleted}, true
		case http.MethodPost:
			return dbWrite{db: db, typ: updateUpdated}, true // a new doc
		default:
			return dbWrite{}, false
		}
	}
	rest := segs[1:]
	first, err := url.PathUnescape(rest[0])
	if err != nil {
		return dbWrite{}, false
	}
	if name, ok := strings.CutPrefix(first, "_design/"); ok { // "_design%2Fname"
		rest = append([]string{"_design", name}, rest[1:]...)
		first = "_design"
	}
	updated := dbWrite{db: db, typ: updateUpdated}
	switch {
	case first == "_design":
		switch {
		case len(rest) < 2:
			return dbWrite{}, false
		case len(rest) == 2: // the design doc
			return updated, true
		case rest[2] == "_update": // an update function writes a doc
			return updated, true
		case strings.HasPrefix(rest[2], "_"): // _view, _show, _list, _info, …: reads
			return dbWrite{}, false
		default: // an attachment of the design doc
			return updated, true
		}
	case dbWriteEndpoints[first]:
		return updated, true
	case strings.HasPrefix(first, "_"): // _local/…, _all_docs, _find, _security, …
		return dbWrite{}, false
	default: // a doc or one of its attachments
		return updated, true
	}
}

// dbPath returns the request path of db: '/' and the name escaped as one path segment, '+' as
// %2B so that CouchDB does not read it as a space.
func dbPath(db string) string {
	return "/" + strings.ReplaceAll(url.PathEscape(db), "+", "%2B")
}

package rules

import (
	"net/url"
	"regexp"
	"strings"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// Replication engines (the rule field "engine").
const (
	EngineCouchDB = "couchdb" // POST /_replicate on the watched server (also what "" means)
	EngineNative  = "native"  // the consumer replicates itself (pkg/replicate)
)

// isReplicatorOwnField reports whether a replicator doc field is never passed to _replicate: the
// service's own fields, the ones that would break one-shot replication, and the original
// Spiegel's bookkeeping. Fields starting with "_" (_id, _rev, _conflicts, ...) are excluded too.
func isReplicatorOwnField(k string) bool {
	switch k {
	case "type", "db_name", "disabled", "dirty_after_milliseconds", "engine",
		"continuous", "cancel", "source", "target",
		"dirty", "locked_at", "updated_at", "dirty_at", "retries", "possibly_deleted_at":
		return true
	}
	return strings.HasPrefix(k, "_")
}

// Replicator is a compiled `replicator` rule (SPEC §2.1). A pattern rule (Pattern != nil)
// matches every db whose name Pattern matches (unanchored); an exact rule matches ExactDB only.
type Replicator struct {
	id, rev string
	// Source and Target as written in the doc; they may hold $db_name or ${db_name}. See Resolve.
	Source, Target string
	Pattern        *regexp.Regexp
	// ExactDB is, for exact rules, the db the rule watches: the last path segment of a URL
	// Source, URL-decoded, or a bare-name Source itself. "" for pattern rules.
	ExactDB    string
	Disabled   bool
	DirtyAfter time.Duration // dirty_after_milliseconds: delay the first run to absorb bursts
	Engine     string        // "", EngineCouchDB or EngineNative
	// Params holds every other field of the doc, to pass to _replicate as is (numbers are
	// json.Number). Treat it as read-only: it is shared by every caller.
	Params map[string]any
}

// ID returns the doc id.
func (r *Replicator) ID() string { return r.id }

// Rev returns the doc revision the rule was parsed from ("" if the doc had none).
func (r *Replicator) Rev() string { return r.rev }

// Kind returns KindReplicator.
func (r *Replicator) Kind() string { return KindReplicator }

// Enabled reports whether the rule is not disabled.
func (r *Replicator) Enabled() bool { return !r.Disabled }

// Group returns events.GroupReplicate.
func (r *Replicator) Group() events.Group { return events.GroupReplicate }

// MatchesDB reports whether the rule applies to db.
func (r *Replicator) MatchesDB(db string) bool {
	if r.Pattern != nil {
		return r.Pattern.MatchString(db)
	}
	return db == r.ExactDB
}

// Resolve returns the rule's source and target for db, with $db_name and ${db_name} replaced
// by db (no other token is replaced: '$' is legal in db names). In a URL (a string containing "://") the name is percent-encoded like a path segment,
// strictly: every byte outside RFC 3986's unreserved set, including '/', '+', '$', '(' and ')',
// is escaped, because CouchDB decodes '+' in paths as a space. A bare-name source or target gets
// the raw name. Passwords are not injected here (see pkg/passwords).
func (r *Replicator) Resolve(db string) (source, target string) {
	return resolveDBName(r.Source, db), resolveDBName(r.Target, db)
}

func resolveDBName(tmpl, db string) string {
	if !strings.Contains(tmpl, "$") {
		return tmpl
	}
	return interpolate(tmpl, Vars{DBName: db}, isURL(tmpl), true, true)
}

func isURL(s string) bool { return strings.Contains(s, "://") }

func parseReplicator(f fields) (*Replicator, error) {
	r := &Replicator{id: f.id}
	r.rev, _ = f.doc["_rev"].(string)
	var err error
	for _, field := range []string{"source", "target"} {
		v, err := f.str(field)
		if err != nil {
			return nil, err
		}
		if strings.TrimSpace(v) == "" {
			return nil, f.errorf(field, "required: a database URL or name")
		}
		if err := f.checkURL(field, v); err != nil {
			return nil, err
		}
		if isURL(v) {
			if _, perr := url.Parse(strings.NewReplacer("${db_name}", "x", "$db_name", "x").Replace(v)); perr != nil {
				return nil, f.errorf(field, "not a valid URL")
			}
		}
		if field == "source" {
			r.Source = v
		} else {
			r.Target = v
		}
	}
	if r.Disabled, err = f.boolean("disabled"); err != nil {
		return nil, err
	}
	if r.DirtyAfter, err = f.millis("dirty_after_milliseconds", 0); err != nil {
		return nil, err
	}
	if r.Engine, err = f.str("engine"); err != nil {
		return nil, err
	}
	if r.Engine != "" && r.Engine != EngineCouchDB && r.Engine != EngineNative {
		return nil, f.errorf("engine", "must be %q or %q", EngineCouchDB, EngineNative)
	}
	if f.present("db_name") {
		src, err := f.str("db_name")
		if err != nil {
			return nil, err
		}
		if r.Pattern, err = regexp.Compile(src); err != nil {
			return nil, f.errorf("db_name", "invalid regular expression (RE2 syntax): %v", err)
		}
	} else {
		if strings.Contains(r.Source, "$db_name") || strings.Contains(r.Source, "${db_name}") {
			return nil, f.errorf("source", "uses $db_name, which needs a db_name pattern")
		}
		if r.ExactDB, err = exactDBName(r.Source); err != nil {
			return nil, f.errorf("source", "%v", err)
		}
	}
	r.Params = map[string]any{}
	for k, v := range f.doc {
		if isReplicatorOwnField(k) {
			continue
		}
		if s, ok := v.(string); ok {
			if err := f.checkURL(k, s); err != nil {
				return nil, err
			}
		}
		r.Params[k] = v
	}
	return r, nil
}

// exactDBName returns the db an exact rule's source names: the last path segment of a URL,
// percent-decoded, or a bare name as is.
func exactDBName(source string) (string, error) {
	if !isURL(source) {
		return source, nil
	}
	rest := source[strings.Index(source, "://")+3:]
	if i := strings.IndexAny(rest, "?#"); i >= 0 {
		rest = rest[:i]
	}
	slash := strings.IndexByte(rest, '/')
	if slash < 0 {
		return "", errString("the URL must name a database in its path")
	}
	path := strings.TrimRight(rest[slash:], "/")
	seg := path[strings.LastIndexByte(path, '/')+1:]
	if seg == "" {
		return "", errString("the URL must name a database in its path")
	}
	name, err := url.PathUnescape(seg)
	if err != nil {
		return "", errString("the database name in the URL has an invalid percent-encoding")
	}
	return name, nil
}

type errString string

func (e errString) Error() string { return string(e) }

package replicate

import (
	"context"
	"crypto/md5" //nolint:gosec // an identifier, as CouchDB's, not a security boundary
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// EngineVersion is part of every replication id: bump it when the checkpoint format or the
// meaning of a recorded seq changes, so that old checkpoints are ignored rather than misread.
const EngineVersion = "spiegel-native-1"

// ReplicationID returns the id of the replication opt describes: the hex MD5 of EngineVersion,
// the source and target URLs without credentials (scheme and host lower-cased, no trailing
// slash), the filter, query_params, doc_ids and selector, and filterCode: the source code of a
// design-doc filter, as CouchDB's replicator does, so that editing the filter starts a new
// replication instead of reusing a checkpoint taken with other code. It does not depend on
// credentials, BatchSize, Workers, CheckpointInterval or CreateTarget, and it is stable across
// restarts and hosts: the checkpoint doc of the replication is `_local/<id>` on both sides.
func ReplicationID(opt Options, filterCode string) string {
	key := struct {
		Version     string         `json:"v"`
		Source      string         `json:"source"`
		Target      string         `json:"target"`
		Filter      string         `json:"filter,omitempty"`
		QueryParams map[string]any `json:"query_params,omitempty"`
		DocIDs      []string       `json:"doc_ids,omitempty"`
		Selector    map[string]any `json:"selector,omitempty"`
		FilterCode  string         `json:"filter_code,omitempty"`
	}{EngineVersion, idURL(opt.Source), idURL(opt.Target), opt.Filter, opt.QueryParams, opt.DocIDs, opt.Selector, filterCode}
	data, err := json.Marshal(key) // map keys come out sorted: stable
	if err != nil {
		// Values that do not encode (channels, funcs) cannot come from JSON config; keep the id
		// defined anyway.
		data = []byte(key.Version + "\x00" + key.Source + "\x00" + key.Target + "\x00" + key.Filter + "\x00" + filterCode)
	}
	sum := md5.Sum(data) //nolint:gosec // see import
	return hex.EncodeToString(sum[:])
}

// idURL normalises a db URL for the replication id: credentials removed.
func idURL(raw string) string {
	u, err := url.Parse(strings.TrimRight(raw, "/"))
	if err != nil {
		return logging.RedactText(raw) // Run rejects it anyway
	}
	u.User = nil
	u.Scheme = strings.ToLower(u.Scheme)
	u.Host = strings.ToLower(u.Host)
	return u.String()
}

// designFilter returns the design doc and function name of a filter defined in a design doc
// ("ddoc/name"), and false for the built-in filters ("_doc_ids", "_selector", "_view", ...).
func designFilter(filter string) (ddoc, name string, ok bool) {
	if filter == "" || strings.HasPrefix(filter, "_") {
		return "", "", false
	}
	ddoc, name, ok = strings.Cut(filter, "/")
	return ddoc, name, ok && ddoc != "" && name != ""
}

// filterCode reads the source code of the replication's design-doc filter from the source, or ""
// when it has none. A missing design doc or filter is an error naming it.
func (r *run) filterCode(ctx context.Context) (string, error) {
	ddoc, name, ok := designFilter(r.opt.Filter)
	if !ok {
		return "", nil
	}
	var doc struct {
		Filters map[string]string `json:"filters"`
	}
	if err := r.src.do(ctx, http.MethodGet, r.src.docPath("_design/"+ddoc), nil, nil, &doc); err != nil {
		return "", fmt.Errorf("read filter %s: %w", r.opt.Filter, err)
	}
	code, ok := doc.Filters[name]
	if !ok {
		return "", fmt.Errorf("filter %s: the design doc _design/%s has no filter %q", r.opt.Filter, ddoc, name)
	}
	return code, nil
}

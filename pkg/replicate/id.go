package replicate

import (
	"crypto/md5" //nolint:gosec // an identifier, as CouchDB's, not a security boundary
	"encoding/hex"
	"encoding/json"
	"net/url"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// EngineVersion is part of every replication id: bump it when the checkpoint format or the
// meaning of a recorded seq changes, so that old checkpoints are ignored rather than misread.
const EngineVersion = "spiegel-native-1"

// ReplicationID returns the id of the replication opt describes: the hex MD5 of EngineVersion,
// the source and target URLs without credentials (scheme and host lower-cased, no trailing
// slash), the filter, query_params, doc_ids and selector. It does not depend on credentials,
// BatchSize, Workers, CheckpointInterval or CreateTarget, and it is stable across restarts and
// hosts: the checkpoint doc of the replication is `_local/<id>` on both sides.
func ReplicationID(opt Options) string {
	key := struct {
		Version     string         `json:"v"`
		Source      string         `json:"source"`
		Target      string         `json:"target"`
		Filter      string         `json:"filter,omitempty"`
		QueryParams map[string]any `json:"query_params,omitempty"`
		DocIDs      []string       `json:"doc_ids,omitempty"`
		Selector    map[string]any `json:"selector,omitempty"`
	}{EngineVersion, idURL(opt.Source), idURL(opt.Target), opt.Filter, opt.QueryParams, opt.DocIDs, opt.Selector}
	data, err := json.Marshal(key) // map keys come out sorted: stable
	if err != nil {
		// Values that do not encode (channels, funcs) cannot come from JSON config; keep the id
		// defined anyway.
		data = []byte(key.Version + "\x00" + key.Source + "\x00" + key.Target + "\x00" + key.Filter)
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

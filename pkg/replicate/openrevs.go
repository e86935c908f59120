package replicate

import (
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"strings"
)

// openRevsAnswer is the answer of GET /db/id?open_revs=[...]: a JSON array of {"ok": doc} or
// {"missing": rev} (asked with Accept: application/json; PouchDB Server only sends that), or a
// multipart/mixed body of application/json parts, one doc each, from a server that ignores the
// Accept header. A part that is itself multipart (a doc with attachments sent as "follows") is
// an error: ask with attachments=true, which inlines them, or false, which sends stubs.
type openRevsAnswer []bulkGetResult

func (a *openRevsAnswer) DecodeResponse(contentType string, body io.Reader) error {
	mediaType, params, err := mime.ParseMediaType(contentType)
	if err != nil || !strings.HasPrefix(mediaType, "multipart/") {
		return json.NewDecoder(body).Decode((*[]bulkGetResult)(a))
	}
	mr := multipart.NewReader(body, params["boundary"])
	for {
		part, err := mr.NextPart()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read open_revs part: %w", err)
		}
		pt, _, _ := mime.ParseMediaType(part.Header.Get("Content-Type"))
		if pt != "application/json" {
			return fmt.Errorf("open_revs part of type %q is not supported", pt)
		}
		var raw json.RawMessage
		if err := json.NewDecoder(part).Decode(&raw); err != nil {
			return fmt.Errorf("decode open_revs part: %w", err)
		}
		var missing struct {
			Missing string `json:"missing"`
		}
		if json.Unmarshal(raw, &missing) == nil && missing.Missing != "" {
			*a = append(*a, bulkGetResult{Missing: missing.Missing})
			continue
		}
		*a = append(*a, bulkGetResult{OK: raw})
	}
}

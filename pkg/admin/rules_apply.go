package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"sort"

	"github.com/spiegel-nats/spiegel/pkg/couch"
)

// What ApplyRule did (or, in a dry run, would do) to a rule doc.
const (
	RuleCreated   = "created"
	RuleUpdated   = "updated"
	RuleUnchanged = "unchanged"
)

// ApplyResult is what ApplyRule did to one rule doc.
type ApplyResult struct {
	ID     string `json:"id"`
	File   string `json:"file"`
	Action string `json:"action"` // RuleCreated, RuleUpdated or RuleUnchanged
	// Changed lists the top-level fields an update adds, changes or removes.
	Changed []string `json:"changed,omitempty"`
	// Rev is the doc's revision after the write (the stored one when unchanged; "" in a dry run
	// that would write).
	Rev    string `json:"rev,omitempty"`
	DryRun bool   `json:"dry_run,omitempty"`
}

// ApplyRule makes the stored doc of d.ID equal to d.Doc: it reads the stored doc, leaves it
// alone when it is the same but for its _rev (numbers compared by value), else writes d.Doc
// with the stored _rev (none when there is no doc or only a deleted one). When CouchDB answers
// 409 — the doc changed between the read and the write — it reads again and retries, up to
// writeAttempts times. With dryRun it reads only and reports what it would do. The caller
// checks the doc first (CheckRuleDocs): the spiegel db's validate_doc_update, where CouchDB
// runs it, would refuse an invalid doc with a 403 that ApplyRule returns.
func (db *RulesDB) ApplyRule(ctx context.Context, d RuleFileDoc, dryRun bool) (ApplyResult, error) {
	res := ApplyResult{ID: d.ID, File: d.File, DryRun: dryRun}
	raw, err := json.Marshal(d.Doc)
	if err != nil {
		return res, fmt.Errorf("rule %q: encode: %w", d.ID, err)
	}
	var want map[string]any // numbers as float64, as the stored doc's are decoded
	if err := json.Unmarshal(raw, &want); err != nil {
		return res, fmt.Errorf("rule %q: encode: %w", d.ID, err)
	}
	for attempt := 1; attempt <= writeAttempts; attempt++ {
		var cur map[string]any
		err := db.Couch.DoIdempotent(ctx, http.MethodGet, db.docPath(d.ID), nil, nil, &cur)
		if err != nil && !errors.Is(err, couch.ErrNotFound) {
			return res, fmt.Errorf("read rule %q: %w", d.ID, err)
		}
		rev, _ := cur["_rev"].(string)
		res.Action, res.Changed, res.Rev = RuleCreated, nil, ""
		if cur != nil {
			res.Action, res.Changed = RuleUpdated, changedFields(cur, want)
			if len(res.Changed) == 0 {
				res.Action, res.Rev = RuleUnchanged, rev
				return res, nil
			}
		}
		if dryRun {
			return res, nil
		}
		body := make(map[string]any, len(d.Doc)+1)
		for k, v := range d.Doc {
			body[k] = v
		}
		if rev != "" {
			body["_rev"] = rev
		}
		var ans struct {
			Rev string `json:"rev"`
		}
		err = db.Couch.Do(ctx, http.MethodPut, db.docPath(d.ID), nil, body, &ans)
		if err == nil {
			res.Rev = ans.Rev
			return res, nil
		}
		if !isConflict(err) {
			return res, fmt.Errorf("write rule %q: %w", d.ID, err)
		}
		if err := pause(ctx, attempt); err != nil {
			return res, err
		}
	}
	return res, fmt.Errorf("write rule %q: it changed %d times while being written; try again", d.ID, writeAttempts)
}

// changedFields returns, sorted, the top-level fields in which the stored doc cur and the
// wanted doc differ, _rev aside.
func changedFields(cur, want map[string]any) []string {
	var out []string
	for k, v := range want {
		if k == "_rev" {
			continue
		}
		if cv, ok := cur[k]; !ok || !reflect.DeepEqual(cv, v) {
			out = append(out, k)
		}
	}
	for k := range cur {
		if _, ok := want[k]; !ok && k != "_rev" {
			out = append(out, k)
		}
	}
	sort.Strings(out)
	return out
}

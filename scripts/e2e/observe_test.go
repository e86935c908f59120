package e2e

import (
	"context"
	"encoding/json"
	"net/http"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// docIDs returns the ids of db's docs (none when db does not exist yet).
func docIDs(t testing.TB, cs *couchtest.Server, db string) []string {
	t.Helper()
	var all struct {
		Rows []struct {
			ID string `json:"id"`
		} `json:"rows"`
	}
	if err := cs.Do(t, http.MethodGet, "/"+couchtest.PathDB(db)+"/_all_docs", nil, &all); err != nil {
		return nil
	}
	var ids []string
	for _, r := range all.Rows {
		if !strings.HasPrefix(r.ID, "_") {
			ids = append(ids, r.ID)
		}
	}
	sort.Strings(ids)
	return ids
}

// goodCalls returns the webhook calls of the hook rule made with password and signed with key,
// one per (db, doc id).
func goodCalls(calls []hookCall, srcPrefix, password, key string) []hookCall {
	seen := map[string]bool{}
	var out []hookCall
	for _, c := range calls {
		var body struct{ DB, ID string }
		if !strings.HasPrefix(c.Path, "/hook/"+srcPrefix) || c.User != "hook" || c.Password != password || !c.signedWith(key) ||
			json.Unmarshal(c.Body, &body) != nil || seen[body.DB+"/"+body.ID] {
			continue
		}
		seen[body.DB+"/"+body.ID] = true
		out = append(out, c)
	}
	return out
}

// streamMessages returns every message stored in stream (none when it does not exist).
func streamMessages(t testing.TB, js jetstream.JetStream, stream string) []*jetstream.RawStreamMsg {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil
	}
	info, err := s.Info(ctx)
	if err != nil || info.State.Msgs == 0 {
		return nil
	}
	var msgs []*jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		if m, err := s.GetMsg(ctx, seq); err == nil {
			msgs = append(msgs, m)
		}
	}
	return msgs
}

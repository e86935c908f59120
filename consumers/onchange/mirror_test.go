package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/checkpoint"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
	"github.com/spiegel-nats/spiegel/pkg/healthtest"
	"github.com/spiegel-nats/spiegel/pkg/mirrorkey"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// bucketDocs is the mirror bucket of the tests (each env has its own NATS server).
const bucketDocs = "DOCS"

// mirrorOf rebuilds db's docs from bucket's current values, without reading CouchDB. Deleted keys
// are left out.
func (e *env) mirrorOf(t testing.TB, bucket, db string) map[string]map[string]any {
	t.Helper()
	s, err := e.JS.Stream(t.Context(), "KV_"+bucket)
	require.NoError(t, err)
	// Not a KV watch: in a bucket whose values expire, one that expired between the watch's
	// start and its delivery leaves the watch waiting for it, without the end of its initial
	// values.
	subject := "$KV." + bucket + "."
	last, err := natsjs.LastPerSubject(t.Context(), s, subject+mirrorkey.DBPrefix(db), false, time.Second)
	require.NoError(t, err)
	out := map[string]map[string]any{}
	for subj, m := range last {
		gotDB, id, err := mirrorkey.Decode(strings.TrimPrefix(subj, subject))
		require.NoError(t, err)
		require.Equal(t, db, gotDB)
		if !natsjs.KVDeleted(m.Header) {
			out[id] = decodeObject(t, m.Data)
		}
	}
	return out
}

// keyRevisions returns the revision (stream sequence) of each key of db in kv.
func keyRevisions(t testing.TB, kv jetstream.KeyValue, db string) map[string]uint64 {
	t.Helper()
	lister, err := kv.ListKeysFiltered(t.Context(), mirrorkey.DBPrefix(db))
	require.NoError(t, err)
	out := map[string]uint64{}
	for k := range lister.Keys() {
		e, err := kv.Get(t.Context(), k)
		require.NoError(t, err)
		out[k] = e.Revision()
	}
	require.NotEmpty(t, out)
	return out
}

func decodeObject(t testing.TB, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	require.NoError(t, dec.Decode(&m), "%s", b)
	return m
}

// winners returns every live doc of db at its winning revision, as CouchDB serves it.
func (e *env) winners(t testing.TB, db string) map[string]map[string]any {
	t.Helper()
	var body struct {
		Rows []struct {
			ID  string          `json:"id"`
			Doc json.RawMessage `json:"doc"`
		} `json:"rows"`
	}
	require.NoError(t, e.Couch.Do(t, "GET", "/"+couchtest.PathDB(db)+"/_all_docs?include_docs=true", nil, &body))
	out := map[string]map[string]any{}
	for _, r := range body.Rows {
		out[r.ID] = decodeObject(t, r.Doc)
	}
	return out
}

// mirrorEquals reports whether the mirror holds exactly db's winning revisions; it returns a
// description of the first difference.
func (e *env) mirrorEquals(t testing.TB, bucket, db string) (bool, string) {
	t.Helper()
	if _, err := e.JS.KeyValue(t.Context(), bucket); err != nil {
		return false, "no bucket yet: " + err.Error()
	}
	got, want := e.mirrorOf(t, bucket, db), e.winners(t, db)
	for id, doc := range want {
		g, ok := got[id]
		if !ok {
			return false, "doc " + id + " missing from the mirror"
		}
		if !assert.ObjectsAreEqual(doc, g) {
			return false, fmt.Sprintf("doc %s: mirror %v, CouchDB %v", id, g, doc)
		}
	}
	for id := range got {
		if _, ok := want[id]; !ok {
			return false, "doc " + id + " in the mirror but not live in CouchDB"
		}
	}
	return true, ""
}

func (e *env) requireMirror(t testing.TB, bucket, db string) {
	t.Helper()
	var why string
	require.Eventually(t, func() bool {
		var ok bool
		ok, why = e.mirrorEquals(t, bucket, db)
		return ok
	}, 30*time.Second, 50*time.Millisecond, "mirror %s of %s", bucket, db)
	_ = why
	ok, why := e.mirrorEquals(t, bucket, db)
	require.True(t, ok, why)
}

// bulkNoEdits writes docs as given, revisions included (new_edits=false: how replication
// writes, and how conflicts are made).
func (e *env) bulkNoEdits(t testing.TB, db string, docs ...map[string]any) {
	t.Helper()
	require.NoError(t, e.Couch.Do(t, "POST", "/"+couchtest.PathDB(db)+"/_bulk_docs",
		map[string]any{"docs": docs, "new_edits": false}, nil))
}

func (e *env) deleteDoc(t testing.TB, db, id, rev string) {
	t.Helper()
	require.NoError(t, e.Couch.Do(t, "DELETE", "/"+couchtest.PathDB(db)+"/"+url.PathEscape(id)+"?rev="+url.QueryEscape(rev), nil, nil))
}

// TestMirrorWinningRevisions: a mirror rule keeps every doc of the db at its winning revision in
// the bucket (created by the consumer: history 1), through creates, updates, deletes (KV
// deletes), a doc deleted and created again, and a conflict (CouchDB's winner); a replay of
// the rule leaves the mirror equal and rewrites nothing.
func TestMirrorWinningRevisions(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	bucket := bucketDocs
	e.ruleIn(t, app, "mir", db, map[string]any{"mirror": bucket})

	revs := map[string]string{}
	for _, id := range []string{"a", "b", "c", "d.e/f", "gone", "again"} {
		revs[id] = e.Couch.Put(t, db, id, map[string]any{"v": 1, "name": id})
	}
	e.enqueue(t, db)
	e.requireMirror(t, bucket, db)

	kv, err := e.JS.KeyValue(t.Context(), bucket)
	require.NoError(t, err)
	st, err := kv.Status(t.Context())
	require.NoError(t, err)
	assert.EqualValues(t, 1, st.History(), "the consumer creates the bucket with history 1")

	// Updates, deletes, a doc deleted and created again, a conflict.
	revs["a"] = e.Couch.Put(t, db, "a", map[string]any{"_rev": revs["a"], "v": 2})
	revs["a"] = e.Couch.Put(t, db, "a", map[string]any{"_rev": revs["a"], "v": 3})
	e.deleteDoc(t, db, "gone", revs["gone"])
	e.deleteDoc(t, db, "again", revs["again"])
	e.Couch.Put(t, db, "again", map[string]any{"v": "second life"})
	e.bulkNoEdits(t, db,
		map[string]any{"_id": "conflict", "_rev": "1-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "side": "loser"},
		map[string]any{"_id": "conflict", "_rev": "1-ffffffffffffffffffffffffffffffff", "side": "winner"})
	e.enqueue(t, db)
	e.requireMirror(t, bucket, db)
	_, err = kv.Get(t.Context(), mirrorkey.Encode(db, "gone"))
	assert.ErrorIs(t, err, jetstream.ErrKeyNotFound, "a deleted doc is a KV delete")
	got := e.mirrorOf(t, bucket, db)
	assert.Equal(t, "winner", got["conflict"]["side"], "the conflict is mirrored as CouchDB's winner")
	assert.Equal(t, "second life", got["again"]["v"])

	// The winner changes: delete the winning branch, the other one wins.
	e.deleteDoc(t, db, "conflict", "1-ffffffffffffffffffffffffffffffff")
	e.enqueue(t, db)
	e.requireMirror(t, bucket, db)
	assert.Equal(t, "loser", e.mirrorOf(t, bucket, db)["conflict"]["side"])
	require.Eventually(t, func() bool { return e.caughtUp(t, "mir", db) }, 30*time.Second, 20*time.Millisecond)

	// A replay rewrites nothing: no doc key gets a new message (its jobs claim the db: the fence
	// key's only).
	before := keyRevisions(t, kv, db)
	e.replay(t, "mir", db)
	e.enqueue(t, db)
	require.Eventually(t, func() bool { return e.caughtUp(t, "mir", db) }, 30*time.Second, 20*time.Millisecond)
	e.requireMirror(t, bucket, db)
	assert.Equal(t, before, keyRevisions(t, kv, db), "a replay of the same winning revisions writes nothing")
	assert.Empty(t, e.deadLettersOf(t, db))
}

// TestMirrorTooLarge: a doc larger than the bucket's max value size is mirrored as a small
// reference and dead-lettered with rule, db and doc; the db's other docs still mirror, and the
// rule's checkpoint passes it.
func TestMirrorTooLarge(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	bucket := "MIRROR_SMALL"
	_, err := e.JS.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: bucket, History: 1, MaxValueSize: 1024})
	require.NoError(t, err)
	e.ruleIn(t, app, "mir", db, map[string]any{"mirror": bucket, "retry": map[string]any{"backoff": "linear", "delay_ms": 10, "limit": 1}})

	e.Couch.Put(t, db, "small1", map[string]any{"v": 1})
	bigRev := e.Couch.Put(t, db, "big", map[string]any{"blob": strings.Repeat("x", 4000)})
	e.Couch.Put(t, db, "small2", map[string]any{"v": 2})
	longID := strings.Repeat("l", 3000) // its key would not fit in a NATS subject
	e.Couch.Put(t, db, longID, map[string]any{"v": 3})
	e.enqueue(t, db)
	require.Eventually(t, func() bool { return e.caughtUp(t, "mir", db) }, 30*time.Second, 20*time.Millisecond)

	got := e.mirrorOf(t, bucket, db)
	want := e.winners(t, db)
	assert.Equal(t, want["small1"], got["small1"])
	assert.Equal(t, want["small2"], got["small2"])
	assert.Equal(t, map[string]any{"_id": "big", "_rev": bigRev, "too_large": true, "size": got["big"]["size"]}, got["big"])
	assert.NotContains(t, got, longID)
	dls := e.deadLettersOf(t, db)
	require.Len(t, dls, 2)
	byDoc := map[string]int{}
	for i, d := range dls {
		assert.Equal(t, "mir", d.Rule)
		assert.Equal(t, bucket, d.Details["bucket"])
		byDoc[d.DocID] = i
	}
	require.Contains(t, byDoc, "big")
	require.Contains(t, byDoc, longID)
	assert.Contains(t, dls[byDoc["big"]].Error, "max value size")
	assert.Contains(t, dls[byDoc[longID]].Error, "too long for a KV key")
}

// TestPerDocOrderSharded: on a db with several shards (q=4 on CouchDB 3; PouchDB has one feed)
// the feed has no global write order, but a subject rule still publishes each doc's revisions in
// revision order, each once, the last one being the doc's current winning revision; and a mirror
// rule on the same db ends with every doc's winning revision. The writes interleave across docs
// while the consumer runs, in pages of a few changes.
func TestPerDocOrderSharded(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	e.cfg.BatchSize = 7
	app := e.start(t)
	db := couchtest.UniqueName(t, e.Prefix)
	require.NoError(t, e.Couch.Do(t, "PUT", "/"+couchtest.PathDB(db)+"?q=4", nil, nil))
	e.Couch.Cleanup(t, db)
	var dbInfo struct {
		Cluster *struct {
			Q int `json:"q"`
		} `json:"cluster"`
	}
	require.NoError(t, e.Couch.Do(t, "GET", "/"+couchtest.PathDB(db), nil, &dbInfo))
	if dbInfo.Cluster != nil { // CouchDB 2+; PouchDB Server has no shards
		require.Equal(t, 4, dbInfo.Cluster.Q, "the db has 4 shards")
	} else {
		t.Log("the server does not shard dbs: per-doc order is checked on one feed")
	}
	e.ruleIn(t, app, "pub", db, map[string]any{"subject": "spiegel.changes.${db_name}"})
	e.ruleIn(t, app, "mir", db, map[string]any{"mirror": "DOCS"})

	const docs, rounds = 16, 8
	revs := map[string]string{}
	for r := 0; r < rounds; r++ {
		for d := 0; d < docs; d++ {
			id := fmt.Sprintf("doc%02d", d)
			if (d+r)%5 == 4 && revs[id] != "" && r < rounds-1 { // some docs deleted and created again
				e.deleteDoc(t, db, id, revs[id])
				revs[id] = ""
				continue
			}
			doc := map[string]any{"round": r}
			if revs[id] != "" {
				doc["_rev"] = revs[id]
			}
			revs[id] = e.Couch.Put(t, db, id, doc)
		}
		e.enqueue(t, db)
	}
	require.Eventually(t, func() bool { return e.caughtUp(t, "pub", db) && e.caughtUp(t, "mir", db) },
		60*time.Second, 50*time.Millisecond)
	e.requireMirror(t, bucketDocs, db)

	stream, err := e.JS.Stream(t.Context(), "SPIEGEL_CHANGES")
	require.NoError(t, err)
	info, err := stream.Info(t.Context())
	require.NoError(t, err)
	subject := subjectFor(&rules.OnChange{Subject: "spiegel.changes.${db_name}"}, db)
	published := map[string][]string{} // doc id -> revs in stream order
	for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := stream.GetMsg(t.Context(), seq)
		require.NoError(t, err)
		if m.Subject != subject {
			continue
		}
		var c changeMessage
		require.NoError(t, json.Unmarshal(m.Data, &c))
		published[c.ID] = append(published[c.ID], c.Changes[0].Rev)
	}
	winners := e.winners(t, db)
	require.Len(t, published, docs)
	for id, rs := range published {
		for i := 1; i < len(rs); i++ {
			require.Less(t, revGen(t, rs[i-1]), revGen(t, rs[i]), "doc %s: revisions out of order or twice on the stream: %v", id, rs)
		}
		last := rs[len(rs)-1]
		if w, ok := winners[id]; ok {
			require.Equal(t, w["_rev"], last, "doc %s: the last message is its current winning revision: %v", id, rs)
		} else {
			require.Equal(t, revs[id], "", "doc %s", id)
		}
	}
}

// revGen returns the generation of a revision ("3-abc" -> 3).
func revGen(t testing.TB, rev string) int {
	t.Helper()
	var n int
	_, err := fmt.Sscanf(rev, "%d-", &n)
	require.NoError(t, err, "rev %q", rev)
	return n
}

// TestMirrorRecreatedDB: a db deleted and created again is mirrored as the new db: the old db's
// docs leave the mirror (KV deletes) even those the new db does not have.
func TestMirrorRecreatedDB(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.ruleIn(t, app, "mir", db, map[string]any{"mirror": bucketDocs})
	e.Couch.Put(t, db, "old1", map[string]any{"v": 1})
	e.Couch.Put(t, db, "both", map[string]any{"v": 1})
	e.enqueue(t, db)
	e.requireMirror(t, bucketDocs, db)
	require.Len(t, e.mirrorOf(t, bucketDocs, db), 2)

	require.NoError(t, e.Couch.Do(t, "DELETE", "/"+couchtest.PathDB(db), nil, nil))
	require.NoError(t, e.Couch.Do(t, "PUT", "/"+couchtest.PathDB(db), nil, nil))
	e.Couch.Put(t, db, "both", map[string]any{"v": 2})
	e.Couch.Put(t, db, "new", map[string]any{"v": 2})
	e.enqueue(t, db)
	e.requireMirror(t, bucketDocs, db)
	got := e.mirrorOf(t, bucketDocs, db)
	assert.NotContains(t, got, "old1")
	assert.Equal(t, json.Number("2"), got["both"]["v"])
}

// mirroredDB starts an onchange consumer whose rule "mir" mirrors a new db into bucketDocs, writes
// docs ids into the db ({"v": 1}) and waits until they are mirrored.
func mirroredDB(t *testing.T, ids ...string) (*env, string) {
	t.Helper()
	e := newEnv(t, 60*time.Second)
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.ruleIn(t, app, "mir", db, map[string]any{"mirror": bucketDocs})
	for _, id := range ids {
		e.Couch.Put(t, db, id, map[string]any{"v": 1})
	}
	e.enqueue(t, db)
	e.requireMirror(t, bucketDocs, db)
	return e, db
}

// TestMirrorOfARecreatedDBWithAStaleCheckpointDoc: a db deleted and created again whose new
// incarnation holds the old one's checkpoint doc — CouchDB 3 does not check the revs of _local
// docs, so a save sent after the db was created again lands in the new db, lineage and all —
// must be recognised as new: the old db's docs leave the mirror. The checkpoint names the old
// db's identity (checkpoint.IdentityID), which the new db does not have. The test writes the
// stale doc without a rev, so the new db takes it on PouchDB Server too.
func TestMirrorOfARecreatedDBWithAStaleCheckpointDoc(t *testing.T) {
	e, db := mirroredDB(t, "old1")
	require.Eventually(t, func() bool { return e.caughtUp(t, "mir", db) }, 10*time.Second, 20*time.Millisecond)
	var doc map[string]any
	require.NoError(t, e.Couch.Do(t, http.MethodGet, "/"+couchtest.PathDB(db)+"/_local/"+checkpoint.LocalPrefix+"mir", nil, &doc))
	delete(doc, "_rev")

	require.NoError(t, e.Couch.Do(t, http.MethodDelete, "/"+couchtest.PathDB(db), nil, nil))
	require.NoError(t, e.Couch.Do(t, http.MethodPut, "/"+couchtest.PathDB(db), nil, nil))
	require.NoError(t, e.Couch.Do(t, http.MethodPut, "/"+couchtest.PathDB(db)+"/_local/"+checkpoint.LocalPrefix+"mir", doc, nil))
	e.Couch.Put(t, db, "new1", map[string]any{"v": 2})
	e.enqueue(t, db)
	e.requireMirror(t, bucketDocs, db)
	got := e.mirrorOf(t, bucketDocs, db)
	assert.NotContains(t, got, "old1")
	assert.Contains(t, got, "new1")
}

// TestMirrorOfADeletedDBLeavesNoFence: each job of a mirrored db claims it in the bucket (the
// db's fence key); once the db is deleted its job drops the keys and removes the fence too, so a
// deleted db leaves only its keys' delete markers behind.
func TestMirrorOfADeletedDBLeavesNoFence(t *testing.T) {
	e, db := mirroredDB(t, "d1")
	kv, err := e.JS.KeyValue(t.Context(), bucketDocs)
	require.NoError(t, err)
	_, err = kv.Get(t.Context(), mirrorkey.Fence(db))
	require.NoError(t, err, "the job claimed the db")

	require.NoError(t, e.Couch.Do(t, "DELETE", "/"+couchtest.PathDB(db), nil, nil))
	e.enqueue(t, db)
	require.Eventually(t, func() bool {
		_, err := kv.Get(t.Context(), mirrorkey.Fence(db))
		return errors.Is(err, jetstream.ErrKeyNotFound)
	}, 30*time.Second, 20*time.Millisecond, "the deleted db's fence is removed")
	assert.Empty(t, e.mirrorOf(t, bucketDocs, db))
	_, err = kv.Get(t.Context(), mirrorkey.Fence(db))
	assert.ErrorIs(t, err, jetstream.ErrKeyNotFound, "and leaves no delete marker")
}

// TestMirrorLossReported: the mirror bucket loses a write it had acknowledged — NATS restarted
// from a store older than what it had acknowledged (lazy sync and a power failure) — after the
// rule's checkpoint in CouchDB passed it. The rule's next job finds the bucket without its
// latest write and reports the gap (metric, status naming the db); it drops and rewrites
// nothing: readers may be reading the bucket, and `producer replay` mirrors the db again when
// the operator asks. The new change is mirrored as usual.
func TestMirrorLossReported(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	addr := healthtest.FreeAddr(t)
	e.cfg.HTTPAddr = addr
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.ruleIn(t, app, "mir", db, map[string]any{"mirror": bucketDocs})
	e.Couch.Put(t, db, "a", map[string]any{"v": "a"})
	e.Couch.Put(t, db, "b", map[string]any{"v": "b"})
	e.enqueue(t, db)
	e.requireMirror(t, bucketDocs, db)
	require.Eventually(t, func() bool { return e.caughtUp(t, "mir", db) }, 30*time.Second, 20*time.Millisecond)

	// The copy of the store that the power failure leaves, taken while NATS is down.
	powerFailure := e.storeCopy(t)

	// Right after the restart an ack can go unanswered: the wait covers one redelivery.
	e.Couch.Put(t, db, "c", map[string]any{"v": "c"})
	e.enqueue(t, db)
	require.Eventually(t, func() bool {
		ok, _ := e.mirrorEquals(t, bucketDocs, db)
		return ok && e.caughtUp(t, "mir", db)
	}, 90*time.Second, 50*time.Millisecond)
	cps := e.onChangeStore(t)
	p, err := cps.Load(t.Context(), "mir", db)
	require.NoError(t, err)
	kv, err := e.JS.KeyValue(t.Context(), bucketDocs)
	require.NoError(t, err)
	entry, err := kv.Get(t.Context(), mirrorkey.Encode(db, "c"))
	require.NoError(t, err)
	require.Equal(t, entry.Revision(), p.Stream.Seq, "the checkpoint records the rule's latest write")
	require.NoError(t, cps.SaveNow(t.Context(), &p, p.LastSeq)) // CouchDB is past c when NATS fails

	// The power failure: the store comes back as the copy has it, without c's write, and the
	// checkpoint's cache entry is lost with it (the _local doc is what the next job reads).
	e.powerFailure(t, powerFailure)
	require.NotContains(t, e.mirrorOf(t, bucketDocs, db), "c")
	e.onChangeStore(t).Forget(t.Context(), "mir", db)
	e.Couch.Put(t, db, "d", map[string]any{"v": "d"})
	e.enqueue(t, db)
	require.Eventually(t, func() bool {
		_, ok := e.mirrorOf(t, bucketDocs, db)["d"]
		return ok && e.caughtUp(t, "mir", db)
	}, 90*time.Second, 50*time.Millisecond, "d mirrored")
	assert.Equal(t, []string{"a", "b", "d"}, slices.Sorted(maps.Keys(e.mirrorOf(t, bucketDocs, db))), "nothing dropped or written again for the gap")
	assert.Equal(t, 1.0, healthtest.Scrape(t, addr).Get("spiegel_output_gaps_total", "kind", "mirror"), "the gap is counted")
	assertGapNoted(t, app, "mir", db, "lost the write of key")
}

// powerFailure runs powerFailure (env.storeCopy) and waits for the mirror bucket.
func (e *env) powerFailure(t *testing.T, powerFailure func()) {
	t.Helper()
	powerFailure()
	require.Eventually(t, func() bool {
		_, err := e.JS.KeyValue(t.Context(), bucketDocs)
		return err == nil
	}, 30*time.Second, 50*time.Millisecond)
}

// TestMirrorExpiredByTheBucketIsNoGap: a bucket whose own max age expired the rule's latest write
// has no gap: the write is below the bucket stream's first sequence. Nothing is reported.
func TestMirrorExpiredByTheBucketIsNoGap(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	addr := healthtest.FreeAddr(t)
	e.cfg.HTTPAddr = addr
	app := e.start(t)
	const bucket = "SHORT"
	_, err := e.JS.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: bucket, TTL: time.Second})
	require.NoError(t, err)
	db := e.Couch.NewDB(t, e.Prefix)
	e.ruleIn(t, app, "mir", db, map[string]any{"mirror": bucket})
	e.Couch.Put(t, db, "a", map[string]any{"v": "a"})
	e.enqueue(t, db)
	require.Eventually(t, func() bool { return e.caughtUp(t, "mir", db) }, 30*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { return len(e.mirrorOf(t, bucket, db)) == 0 }, 30*time.Second, 50*time.Millisecond, "a expired")

	// Another db's write: the bucket's first sequence is now past the rule's write.
	kv, err := e.JS.KeyValue(t.Context(), bucket)
	require.NoError(t, err)
	_, err = kv.Put(t.Context(), "other", []byte(`{}`))
	require.NoError(t, err)
	e.Couch.Put(t, db, "b", map[string]any{"v": "b"})
	e.enqueue(t, db)
	require.Eventually(t, func() bool {
		_, ok := e.mirrorOf(t, bucket, db)["b"]
		return ok && e.caughtUp(t, "mir", db)
	}, 30*time.Second, 50*time.Millisecond)
	assert.Zero(t, healthtest.Scrape(t, addr).Get("spiegel_output_gaps_total", "kind", "mirror"), "no gap reported")
}

// TestMirrorKeyWrittenAgainIsNoLoss: the message at the checkpoint's sequence is gone because
// its key was written again since (a later doc revision): no loss, the db is not mirrored again.
func TestMirrorKeyWrittenAgainIsNoLoss(t *testing.T) {
	e := newEnv(t, 60*time.Second)
	addr := healthtest.FreeAddr(t)
	e.cfg.HTTPAddr = addr
	app := e.start(t)
	db := e.Couch.NewDB(t, e.Prefix)
	e.ruleIn(t, app, "mir", db, map[string]any{"mirror": bucketDocs})
	rev := e.Couch.Put(t, db, "a", map[string]any{"v": 1})
	e.enqueue(t, db)
	e.requireMirror(t, bucketDocs, db)
	require.Eventually(t, func() bool { return e.caughtUp(t, "mir", db) }, 30*time.Second, 20*time.Millisecond)
	cp, err := e.onChangeStore(t).Load(t.Context(), "mir", db)
	require.NoError(t, err)
	seen := cp.LastSeq
	// Written again by hand, as another holder would: the key's last message is newer.
	kv, err := e.JS.KeyValue(t.Context(), bucketDocs)
	require.NoError(t, err)
	_, err = kv.Put(t.Context(), mirrorkey.Encode(db, "a"), []byte(`{"_id":"a","_rev":"`+rev+`","v":1}`))
	require.NoError(t, err)

	e.Couch.Put(t, db, "b", map[string]any{"v": 2})
	e.enqueue(t, db)
	e.requireMirror(t, bucketDocs, db)
	require.Eventually(t, func() bool { return e.caughtUp(t, "mir", db) }, 30*time.Second, 20*time.Millisecond)
	assert.NotEqual(t, seen, "", "the rule had a checkpoint")
	assert.Zero(t, healthtest.Scrape(t, addr).Get("spiegel_output_gaps_total", "kind", "mirror"), "no gap reported")
}

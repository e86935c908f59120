package couch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"sync"
)

const (
	// allDBsPage is how many names EachDB asks _all_dbs for at once.
	allDBsPage = 1000
	// dbsInfoBatch is the most keys one POST /_dbs_info carries (CouchDB 3's default
	// max_db_number_for_dbs_info_req is 100).
	dbsInfoBatch = 100
	// dbsInfoConcurrency bounds the POST /_dbs_info batches in flight.
	dbsInfoConcurrency = 4
	// dbInfoConcurrency bounds the GET /{db} requests in flight where _dbs_info is missing.
	dbInfoConcurrency = 8
)

// DBInfo is the part of a db's info document (GET /{db}) the service uses.
type DBInfo struct {
	Name              string
	UpdateSeq         string // opaque
	InstanceStartTime string
	DocCount          int64
}

type dbInfoJSON struct {
	DBName            string `json:"db_name"`
	UpdateSeq         Seq    `json:"update_seq"`
	InstanceStartTime Seq    `json:"instance_start_time"` // a string on CouchDB, may be a number elsewhere
	DocCount          int64  `json:"doc_count"`
}

func (j dbInfoJSON) info(name string) DBInfo {
	if j.DBName != "" {
		name = j.DBName
	}
	return DBInfo{Name: name, UpdateSeq: string(j.UpdateSeq), InstanceStartTime: string(j.InstanceStartTime), DocCount: j.DocCount}
}

// AllDBs returns one page of _all_dbs: at most limit names (limit <= 0: no limit) sorted after
// startAfter ("" = from the start), startAfter itself excluded. Names are filtered on the client
// as well, so a server that ignores startkey or limit (PouchDB Server does) still gives correct
// pages.
func (c *Client) AllDBs(ctx context.Context, startAfter string, limit int) ([]string, error) {
	q := url.Values{}
	if startAfter != "" {
		key, _ := json.Marshal(startAfter) // a string always encodes
		q.Set("startkey", string(key))
	}
	if limit > 0 {
		n := limit
		if startAfter != "" {
			n++ // startkey is inclusive
		}
		q.Set("limit", strconv.Itoa(n))
	}
	var names []string
	if err := c.Do(ctx, http.MethodGet, "/_all_dbs", q, nil, &names); err != nil {
		return nil, fmt.Errorf("list dbs: %w", err)
	}
	out := names[:0]
	for _, n := range names {
		if startAfter == "" || n > startAfter {
			out = append(out, n)
		}
	}
	if !sort.StringsAreSorted(out) {
		sort.Strings(out)
	}
	if limit > 0 && len(out) > limit {
		out = out[:limit]
	}
	return out, nil
}

// EachDB calls fn for every db on the server (system dbs included) in name order, paging
// through _all_dbs 1000 names at a time. It stops at the first error, fn's included, and
// returns it.
func (c *Client) EachDB(ctx context.Context, fn func(db string) error) error {
	after := ""
	for {
		page, err := c.AllDBs(ctx, after, allDBsPage)
		if err != nil {
			return err
		}
		for _, db := range page {
			if err := fn(db); err != nil {
				return err
			}
		}
		if len(page) < allDBsPage {
			return nil
		}
		after = page[len(page)-1]
	}
}

// DBInfo returns the info of db; an error matching ErrNotFound when it does not exist.
func (c *Client) DBInfo(ctx context.Context, db string) (DBInfo, error) {
	var j dbInfoJSON
	if err := c.Do(ctx, http.MethodGet, c.DBPath(db), nil, nil, &j); err != nil {
		return DBInfo{}, fmt.Errorf("read info of db %s: %w", db, err)
	}
	return j.info(db), nil
}

// DBInfos returns the info of each db in dbs that exists; missing dbs are absent from the map.
// It uses POST /_dbs_info in batches of 100 where the server has it, and otherwise (remembered
// after the first 400/404/405) GET /{db} with at most 8 requests in flight. Any other failure
// fails the whole call.
func (c *Client) DBInfos(ctx context.Context, dbs []string) (map[string]DBInfo, error) {
	return c.dbInfos(ctx, dbs, dbsInfoBatch)
}

// dbInfos is DBInfos with batch keys per POST /_dbs_info (1 to 100).
func (c *Client) dbInfos(ctx context.Context, dbs []string, batch int) (map[string]DBInfo, error) {
	if batch <= 0 || batch > dbsInfoBatch {
		batch = dbsInfoBatch
	}
	out := make(map[string]DBInfo, len(dbs))
	if len(dbs) == 0 {
		return out, nil
	}
	if !c.noDBsInfo.Load() {
		err := c.dbsInfoBatches(ctx, dbs, batch, out)
		if err == nil {
			return out, nil
		}
		switch httpStatus(err) {
		case http.StatusBadRequest, http.StatusNotFound, http.StatusMethodNotAllowed:
			c.noDBsInfo.Store(true)
			c.log.WithError(err).Info("server has no POST /_dbs_info: reading db infos one by one")
			clear(out)
		default:
			return nil, err
		}
	}
	var mu sync.Mutex
	err := forEachBounded(ctx, dbInfoConcurrency, len(dbs), func(ctx context.Context, i int) error {
		info, err := c.DBInfo(ctx, dbs[i])
		if errors.Is(err, ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		mu.Lock()
		out[dbs[i]] = info
		mu.Unlock()
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (c *Client) dbsInfoBatches(ctx context.Context, dbs []string, batch int, out map[string]DBInfo) error {
	batches := (len(dbs) + batch - 1) / batch
	var mu sync.Mutex
	one := func(ctx context.Context, i int) error {
		keys := dbs[i*batch : min((i+1)*batch, len(dbs))]
		var rows []struct {
			Key   string      `json:"key"`
			Info  *dbInfoJSON `json:"info"`
			Error string      `json:"error"`
		}
		body := map[string][]string{"keys": keys}
		if err := c.Do(ctx, http.MethodPost, "/_dbs_info", nil, body, &rows); err != nil {
			return fmt.Errorf("read db infos: %w", err)
		}
		mu.Lock()
		defer mu.Unlock()
		for _, r := range rows {
			if r.Error != "" || r.Info == nil {
				continue // not_found: absent from the map
			}
			out[r.Key] = r.Info.info(r.Key)
		}
		return nil
	}
	// The first batch goes alone: on a server without _dbs_info it is the only one sent.
	if err := one(ctx, 0); err != nil {
		return err
	}
	return forEachBounded(ctx, dbsInfoConcurrency, batches-1, func(ctx context.Context, i int) error {
		return one(ctx, i+1)
	})
}

// forEachBounded calls fn(ctx, i) for i in [0, n) with at most limit calls running at once. The
// first error cancels the others' context and is returned.
func forEachBounded(ctx context.Context, limit, n int, fn func(ctx context.Context, i int) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	idx := make(chan int)
	var wg sync.WaitGroup
	for range min(limit, n) {
		wg.Go(func() {
			for i := range idx {
				if err := fn(ctx, i); err != nil {
					cancel(err)
				}
			}
		})
	}
feed:
	for i := range n {
		select {
		case idx <- i:
		case <-ctx.Done():
			break feed
		}
	}
	close(idx)
	wg.Wait()
	if err := context.Cause(ctx); err != nil {
		return err
	}
	return nil
}

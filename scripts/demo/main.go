// Command demo drives the run command's demonstration: it serves a local webhook that prints
// every call, creates a few user dbs with a pattern replicator rule into an aggregate db, an
// on_change rule calling the webhook and one publishing to NATS, then writes docs and prints,
// as they happen, what was replicated, called and published.
//
// With -duration it stops by itself and exits non-zero unless replication, webhook calls and
// NATS publishes were all seen (the headless check of the run command).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
)

type demo struct {
	couch, spiegelDB string
	hc               *http.Client
	webhookCalls     atomic.Int64
	replicated       atomic.Int64
	published        atomic.Int64
}

func main() {
	couchURL := flag.String("couchdb", os.Getenv("SPIEGEL_COUCHDB_URL"), "CouchDB URL with admin credentials")
	natsURL := flag.String("nats", os.Getenv("SPIEGEL_NATS_URL"), "NATS URL")
	spiegelDB := flag.String("db", envOr("SPIEGEL_DB_NAME", "spiegel"), "the spiegel db")
	duration := flag.Duration("duration", 0, "stop after this long and check the results (0: run until Ctrl-C)")
	interval := flag.Duration("interval", 2*time.Second, "time between demo writes")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if *duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *duration)
		defer cancel()
	}
	d := &demo{couch: strings.TrimRight(*couchURL, "/"), spiegelDB: *spiegelDB, hc: &http.Client{Timeout: 10 * time.Second}}
	if err := d.run(ctx, *natsURL, *interval); err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
	fmt.Printf("\ndemo summary: %d docs replicated into demo_all_posts, %d webhook calls, %d changes published to NATS\n",
		d.replicated.Load(), d.webhookCalls.Load(), d.published.Load())
	if *duration > 0 && (d.replicated.Load() == 0 || d.webhookCalls.Load() == 0 || d.published.Load() == 0) {
		fmt.Fprintln(os.Stderr, "demo: the pipeline did not show all three kinds of work")
		os.Exit(1)
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func (d *demo) run(ctx context.Context, natsURL string, interval time.Duration) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go func() { _ = http.Serve(ln, http.HandlerFunc(d.webhook)) }()
	hook := "http://" + ln.Addr().String() + "/hook/${db_name}"
	fmt.Printf("webhook listening on http://%s/hook/<db>\n", ln.Addr())

	nc, err := nats.Connect(natsURL)
	if err != nil {
		return fmt.Errorf("connect to NATS: %w", err)
	}
	defer nc.Close()
	sub, err := nc.Subscribe("spiegel.changes.>", func(m *nats.Msg) {
		d.published.Add(1)
		var ch struct {
			ID string `json:"id"`
		}
		_ = json.Unmarshal(m.Data, &ch)
		fmt.Printf("  nats     %s ← change of doc %s\n", m.Subject, ch.ID)
	})
	if err != nil {
		return err
	}
	defer func() { _ = sub.Unsubscribe() }()

	users := []string{"demo_user_alice", "demo_user_bob", "demo_user_carol"}
	for _, db := range append(users, "demo_all_posts") {
		if err := d.do(ctx, http.MethodPut, "/"+db, nil, nil); err != nil && !strings.Contains(err.Error(), "412") {
			return err
		}
	}
	rulesToPut := map[string]map[string]any{
		"demo_replicate_users": {"type": "replicator", "db_name": "^demo_user_", "source": "$db_name", "target": "demo_all_posts"},
		"demo_webhook":         {"type": "on_change", "db_name": "^demo_user_", "if": map[string]any{"type": "^post$"}, "url": hook, "method": "POST", "params": map[string]any{"db": "$db_name", "change": "$change"}},
		"demo_nats":            {"type": "on_change", "db_name": "^demo_user_", "subject": "spiegel.changes.${db_name}"},
	}
	for id, doc := range rulesToPut {
		if err := d.putFresh(ctx, "/"+d.spiegelDB+"/"+id, doc); err != nil {
			return fmt.Errorf("write rule %s: %w", id, err)
		}
		fmt.Printf("rule %s written\n", id)
	}
	go d.watchAggregate(ctx)
	fmt.Printf("writing a post every %s; Ctrl-C stops everything\n", interval)
	for i := 1; ; i++ {
		db := users[i%len(users)]
		id := fmt.Sprintf("post-%d-%d", time.Now().Unix(), i)
		if err := d.do(ctx, http.MethodPut, "/"+db+"/"+id, map[string]any{"type": "post", "n": i, "text": "hello from " + db}, nil); err != nil {
			fmt.Fprintln(os.Stderr, "write:", err)
		} else {
			fmt.Printf("wrote    %s/%s\n", db, id)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(interval):
		}
	}
}

func (d *demo) webhook(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	var p struct {
		DB     string `json:"db"`
		Change struct {
			ID string `json:"id"`
		} `json:"change"`
	}
	_ = json.Unmarshal(body, &p)
	d.webhookCalls.Add(1)
	fmt.Printf("  webhook %s %s ← change of doc %s in %s\n", r.Method, r.URL.Path, p.Change.ID, p.DB)
	w.WriteHeader(http.StatusOK)
}

// watchAggregate follows the aggregate db and prints every replicated doc.
func (d *demo) watchAggregate(ctx context.Context) {
	since := "now"
	for ctx.Err() == nil {
		var page struct {
			Results []struct {
				ID string `json:"id"`
			} `json:"results"`
			LastSeq json.RawMessage `json:"last_seq"`
		}
		q := "/demo_all_posts/_changes?feed=longpoll&timeout=5000&since=" + since
		if err := d.do(ctx, http.MethodGet, q, nil, &page); err != nil {
			time.Sleep(time.Second)
			continue
		}
		for _, r := range page.Results {
			d.replicated.Add(1)
			fmt.Printf("  replicated %s → demo_all_posts\n", r.ID)
		}
		since = strings.Trim(string(page.LastSeq), `"`)
	}
}

// putFresh writes doc at path, replacing what is there.
func (d *demo) putFresh(ctx context.Context, path string, doc map[string]any) error {
	var cur struct {
		Rev string `json:"_rev"`
	}
	if err := d.do(ctx, http.MethodGet, path, nil, &cur); err == nil && cur.Rev != "" {
		doc["_rev"] = cur.Rev
	}
	return d.do(ctx, http.MethodPut, path, doc, nil)
}

func (d *demo) do(ctx context.Context, method, path string, body, out any) error {
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, d.couch+path, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := d.hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	if resp.StatusCode >= 300 {
		return fmt.Errorf("%s %s: %d %s", method, strings.SplitN(path, "?", 2)[0], resp.StatusCode, bytes.TrimSpace(data))
	}
	if out != nil {
		return json.Unmarshal(data, out)
	}
	return nil
}

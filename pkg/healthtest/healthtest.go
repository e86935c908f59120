// Package healthtest reads the health and metrics endpoints of a process under test: /readyz
// answers and /metrics samples, with waits that end on a condition or a deadline.
package healthtest

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/freeport"
)

// client has a timeout above the readiness checks' own 3s bound.
var client = &http.Client{Timeout: 10 * time.Second}

// FreeAddr returns a loopback address with a port that was free a moment ago, for a process
// whose listener address the test must know in advance (see package freeport).
func FreeAddr(t testing.TB) string {
	t.Helper()
	addr, err := freeport.Addr()
	if err != nil {
		t.Fatalf("healthtest: %v", err)
	}
	return addr
}

// Ready is the body of a /readyz answer: check name → "ok" or what failed.
type Ready struct {
	Ready  bool              `json:"ready"`
	Checks map[string]string `json:"checks"`
}

// GetReady asks http://addr/readyz once.
func GetReady(addr string) (status int, body Ready, err error) {
	resp, err := client.Get("http://" + addr + "/readyz")
	if err != nil {
		return 0, Ready{}, err
	}
	defer resp.Body.Close()
	err = json.NewDecoder(resp.Body).Decode(&body)
	return resp.StatusCode, body, err
}

// WaitReady polls http://addr/readyz until it answers status, and returns that answer's body;
// it fails the test after within.
func WaitReady(t testing.TB, addr string, status int, within time.Duration) Ready {
	t.Helper()
	return WaitReadyWhen(t, addr, within, fmt.Sprintf("status %d", status),
		func(got int, _ Ready) bool { return got == status })
}

// WaitReadyWhen polls http://addr/readyz until an answer satisfies cond (described by what, for
// the failure message), and returns that answer's body; it fails the test after within.
func WaitReadyWhen(t testing.TB, addr string, within time.Duration, what string, cond func(status int, body Ready) bool) Ready {
	t.Helper()
	deadline := time.Now().Add(within)
	var last string
	for {
		got, body, err := GetReady(addr)
		if err == nil && cond(got, body) {
			return body
		}
		last = fmt.Sprintf("status %d, body %+v, error %v", got, body, err)
		if time.Now().After(deadline) {
			t.Fatalf("healthtest: /readyz of %s: no %s within %s; last: %s", addr, what, within, last)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// GetStatus returns the status of a GET of http://addr/path.
func GetStatus(addr, path string) (int, error) {
	resp, err := client.Get("http://" + addr + path)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

// Samples are the samples of one /metrics scrape, keyed by series: the metric name, then its
// labels sorted by name, as in `name{a="x",b="y"}` (just `name` without labels).
type Samples map[string]float64

// Get returns the value of the series name with the given label pairs (name, value, ...), 0 when
// the series does not exist (a counter never incremented).
func (s Samples) Get(name string, labelPairs ...string) float64 {
	return s[Series(name, labelPairs...)]
}

// Has reports whether the series exists.
func (s Samples) Has(name string, labelPairs ...string) bool {
	_, ok := s[Series(name, labelPairs...)]
	return ok
}

// Series renders the key of a series; labelPairs alternate label names and values.
func Series(name string, labelPairs ...string) string {
	if len(labelPairs) == 0 {
		return name
	}
	var labels []string
	for i := 0; i+1 < len(labelPairs); i += 2 {
		labels = append(labels, labelPairs[i]+"="+strconv.Quote(labelPairs[i+1]))
	}
	sort.Strings(labels)
	return name + "{" + strings.Join(labels, ",") + "}"
}

// Scrape reads http://addr/metrics; it fails the test if the endpoint does not answer or the
// text cannot be parsed.
func Scrape(t testing.TB, addr string) Samples {
	t.Helper()
	resp, err := client.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("healthtest: scrape %s: %v", addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("healthtest: scrape %s: status %d", addr, resp.StatusCode)
	}
	s, err := Parse(resp.Body)
	if err != nil {
		t.Fatalf("healthtest: scrape %s: %v", addr, err)
	}
	return s
}

// Parse reads the Prometheus text exposition format (as promhttp writes it: no timestamps).
func Parse(r io.Reader) (Samples, error) {
	out := Samples{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			return nil, fmt.Errorf("parse metrics line %q: no value", line)
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			return nil, fmt.Errorf("parse metrics line %q: %w", line, err)
		}
		key, err := canonical(strings.TrimSpace(line[:i]))
		if err != nil {
			return nil, fmt.Errorf("parse metrics line %q: %w", line, err)
		}
		out[key] = v
	}
	return out, sc.Err()
}

// canonical turns `name{b="y",a="x"}` into the key Series would build.
func canonical(series string) (string, error) {
	name, rest, ok := strings.Cut(series, "{")
	if !ok {
		return series, nil
	}
	rest, ok = strings.CutSuffix(rest, "}")
	if !ok {
		return "", fmt.Errorf("unterminated labels")
	}
	var pairs []string
	for rest != "" {
		k, after, ok := strings.Cut(rest, "=")
		if !ok || !strings.HasPrefix(after, `"`) {
			return "", fmt.Errorf("bad label in %q", rest)
		}
		// Find the closing quote, skipping escaped characters.
		end := -1
		for j := 1; j < len(after); j++ {
			if after[j] == '\\' {
				j++
				continue
			}
			if after[j] == '"' {
				end = j
				break
			}
		}
		if end < 0 {
			return "", fmt.Errorf("unterminated label value in %q", rest)
		}
		v, err := strconv.Unquote(after[:end+1])
		if err != nil {
			return "", fmt.Errorf("label value %s: %w", after[:end+1], err)
		}
		pairs = append(pairs, strings.TrimSpace(k), v)
		rest = strings.TrimPrefix(after[end+1:], ",")
	}
	return Series(name, pairs...), nil
}

package health

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// ProbeTimeout bounds one health probe: the request, connection included, and its answer.
const ProbeTimeout = 3 * time.Second

// ProbeUsage is the help of every binary's healthcheck command.
const ProbeUsage = `%[1]s healthcheck [URL] — exit 0 when URL answers 2xx within 3s, 1 otherwise. URL defaults to
  /healthz on this binary's own listener (SPIEGEL_HTTP_ADDR, read from the environment as the
  running process does; an unspecified host is 127.0.0.1). The container image has no shell or
  curl: Docker and Compose health checks run this command. Kubernetes probes use httpGet.`

// HealthzURL returns the /healthz URL of a listener address such as ":8080", "0.0.0.0:8080" or
// "[::1]:8081": an unspecified host is the loopback.
func HealthzURL(addr string) (string, error) {
	if addr == "" {
		return "", errors.New("SPIEGEL_HTTP_ADDR is empty, so the health listener is off: give the URL to probe")
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("SPIEGEL_HTTP_ADDR %q: want host:port or :port (%v)", addr, err)
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port) + "/healthz", nil
}

// Probe asks url once and returns nil when it answers 2xx within ProbeTimeout (or ctx).
func Probe(ctx context.Context, url string) error {
	ctx, cancel := context.WithTimeout(ctx, ProbeTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
	_ = resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("%s answered %s", logging.RedactText(url), resp.Status)
	}
	return nil
}

// ProbeCommand is the healthcheck command of the binary name: args are its arguments after
// "healthcheck" ([URL] or --help) and addr is the binary's SPIEGEL_HTTP_ADDR. It returns the
// exit code: 0 healthy, 1 not, 2 bad usage.
func ProbeCommand(ctx context.Context, name string, args []string, addr string, stdout, stderr io.Writer) int {
	var url string
	switch {
	case len(args) == 1 && (args[0] == "-h" || args[0] == "--help" || args[0] == "-help"):
		fmt.Fprintf(stdout, ProbeUsage+"\n", name)
		return 0
	case len(args) > 1:
		fmt.Fprintf(stderr, "%s healthcheck: want at most one URL, got %q\n", name, args)
		return 2
	case len(args) == 1:
		url = args[0]
	default:
		var err error
		if url, err = HealthzURL(addr); err != nil {
			fmt.Fprintf(stderr, "%s healthcheck: %v\n", name, err)
			return 2
		}
	}
	if err := Probe(ctx, url); err != nil {
		fmt.Fprintf(stderr, "%s healthcheck: %s\n", name, logging.RedactText(err.Error()))
		return 1
	}
	return 0
}

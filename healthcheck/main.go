// Command healthcheck is the container image's probe for Docker and Compose healthchecks: the
// image is distroless (no shell, curl or wget), so it carries this tiny static client instead.
//
//	healthcheck [URL]   (default http://127.0.0.1:8080/healthz)
//
// It exits 0 when the URL answers 2xx within the timeout, 1 otherwise. Kubernetes does not need
// it: its probes use httpGet.
package main

import (
	"fmt"
	"net/http"
	"os"
	"time"
)

func main() {
	url := "http://127.0.0.1:8080/healthz"
	if len(os.Args) > 1 {
		url = os.Args[1]
	}
	if url == "-h" || url == "--help" {
		fmt.Println("usage: healthcheck [URL]  (exit 0 when URL answers 2xx; default http://127.0.0.1:8080/healthz)")
		return
	}
	client := &http.Client{Timeout: 3 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		fmt.Fprintln(os.Stderr, "healthcheck:", err)
		os.Exit(1)
	}
	_ = resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		fmt.Fprintln(os.Stderr, "healthcheck:", url, resp.Status)
		os.Exit(1)
	}
}

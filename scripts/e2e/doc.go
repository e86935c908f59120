// Package e2e holds end-to-end tests that run the real binaries of bin/ (built by `make build`,
// which the test command runs first) against a real CouchDB and an embedded NATS server. It has
// no code besides its tests.
package e2e

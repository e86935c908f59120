// Package deployments holds no code: its tests validate the deployment files in this directory
// (Dockerfile, docker-compose.yml, kubernetes/) offline, against the configuration of the
// binaries in pkg/config, so a renamed variable or a broken manifest fails the test command.
// The directory is a Go module of its own (github.com/spiegel-nats/spiegel/deployments): the
// libraries these tests need (compose-go, k8s.io/api, kustomize, jsonschema) are not in the
// product's module graph. Run them with `go test ./...` here; the test command does.
package deployments

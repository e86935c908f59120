// Package deployments holds no code: its tests validate the deployment files in this directory
// (Dockerfile, docker-compose.yml, kubernetes/) offline, against the configuration of the
// binaries in pkg/config, so a renamed variable or a broken manifest fails `go test ./...`.
package deployments

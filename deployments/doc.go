// Package deployments holds no code: its tests validate the deployment files in this directory
// (Dockerfile, docker-compose.yml, kubernetes/, the Grafana dashboard and the Prometheus alert
// rules) offline, against the configuration and the metrics of the binaries (pkg/config,
// pkg/metrics, pkg/health), so a renamed variable or metric or a broken manifest fails the test
// command. Package monitoring, below it, generates the dashboard and the PrometheusRule.
// The directory is a Go module of its own (github.com/spiegel-nats/spiegel/deployments): the
// libraries these tests need (compose-go, k8s.io/api, kustomize, jsonschema, the Grafana
// Foundation SDK, Prometheus' rule and PromQL parsers, the Prometheus Operator's types) are not
// in the product's module graph. Run them with `go test ./...` here; the test command does.
package deployments

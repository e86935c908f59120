// Package monitoring builds the Grafana dashboard of Spiegel for NATS (grafana/spiegel.json) and
// the Kubernetes PrometheusRule (kubernetes/monitoring/prometheusrule.yaml) from the Prometheus
// rule file prometheus/spiegel-alerts.yaml. Those generated files are committed; after changing
// this package or the rule file, run `go generate ./monitoring` in deployments/, and the tests
// fail until the committed files match what this package generates.
package monitoring

//go:generate go run ./gen ..

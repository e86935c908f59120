package monitoring

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// Paths, relative to deployments/, of the rule file and of the files generated from this package.
const (
	RulesFile          = "prometheus/spiegel-alerts.yaml"
	DashboardFile      = "grafana/spiegel.json"
	PrometheusRuleFile = "kubernetes/monitoring/prometheusrule.yaml"
)

// ErrNoGroups is returned when the rule file has no top-level "groups:" line.
var ErrNoGroups = errors.New(`no line "groups:" at the top level`)

// Generated returns the content of every generated file (by path relative to deployments/),
// reading the rule file under deploymentsDir.
func Generated(deploymentsDir string) (map[string][]byte, error) {
	dash, err := DashboardJSON()
	if err != nil {
		return nil, err
	}
	rules, err := os.ReadFile(filepath.Join(deploymentsDir, RulesFile))
	if err != nil {
		return nil, fmt.Errorf("read the rule file: %w", err)
	}
	pr, err := PrometheusRule(rules)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", RulesFile, err)
	}
	return map[string][]byte{DashboardFile: dash, PrometheusRuleFile: pr}, nil
}

// PrometheusRule returns the PrometheusRule manifest (monitoring.coreos.com/v1) whose spec is
// the rule file from its "groups:" line on, indented as it is (comments included), so that
// Prometheus and the Prometheus Operator load the same rules. The rule file must hold nothing
// but comments before that line.
func PrometheusRule(rules []byte) ([]byte, error) {
	lines := bytes.SplitAfter(rules, []byte("\n"))
	start := -1
	for i, l := range lines {
		if bytes.Equal(bytes.TrimRight(l, " \r\n"), []byte("groups:")) {
			start = i
			break
		}
		if t := bytes.TrimSpace(l); len(t) > 0 && t[0] != '#' && !bytes.Equal(t, []byte("---")) {
			return nil, fmt.Errorf("line %d: only comments may come before groups:", i+1)
		}
	}
	if start < 0 {
		return nil, ErrNoGroups
	}
	var b bytes.Buffer
	b.WriteString(prometheusRuleHeader)
	for _, l := range lines[start:] {
		if len(bytes.TrimSpace(l)) > 0 {
			b.WriteString("  ")
		}
		b.Write(l)
	}
	if !bytes.HasSuffix(b.Bytes(), []byte("\n")) {
		b.WriteByte('\n')
	}
	return b.Bytes(), nil
}

const prometheusRuleHeader = `# Generated from deployments/` + RulesFile + ` by ` + "`go generate ./monitoring`" + ` in
# deployments/: edit that file, not this one. The Prometheus Operator loads it; add the labels
# your Prometheus' ruleSelector asks for (e.g. release: <name> with kube-prometheus-stack).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: spiegel
  labels:
    app.kubernetes.io/name: spiegel
    app.kubernetes.io/part-of: spiegel
spec:
`

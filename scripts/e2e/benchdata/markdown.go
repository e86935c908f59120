package benchdata

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

// EndpointTable renders a run's CouchDB requests per written doc and per idle second, by process
// and endpoint, as a Markdown table.
func EndpointTable(r Run) string {
	var sb strings.Builder
	sb.WriteString("| process | endpoint | per doc | while idle, per s |\n|---|---|---|---|\n")
	idleFor := r.IdleEndS - r.IdleStartS
	names := map[string]bool{}
	for name := range r.Requests {
		names[name] = true
	}
	for name := range r.IdleRequests {
		names[name] = true
	}
	for _, name := range slices.Sorted(maps.Keys(names)) {
		eps := map[string]bool{}
		for ep := range r.Requests[name] {
			eps[ep] = true
		}
		for ep := range r.IdleRequests[name] {
			eps[ep] = true
		}
		for _, ep := range slices.Sorted(maps.Keys(eps)) {
			idle := 0.0
			if idleFor > 0 {
				idle = float64(r.IdleRequests[name][ep]) / idleFor
			}
			fmt.Fprintf(&sb, "| %s | `%s` | %.2f | %.2f |\n", name, ep, r.PerDoc(r.Requests[name][ep]), idle)
		}
	}
	return sb.String()
}

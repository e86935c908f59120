package monitoring

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/variants"
	"github.com/grafana/grafana-foundation-sdk/go/common"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
	"github.com/grafana/grafana-foundation-sdk/go/prometheus"
	"github.com/grafana/grafana-foundation-sdk/go/stat"
	"github.com/grafana/grafana-foundation-sdk/go/statetimeline"
	"github.com/grafana/grafana-foundation-sdk/go/timeseries"
)

// DashboardUID is the dashboard's uid: importing the JSON again replaces the same dashboard.
const DashboardUID = "spiegel-nats"

// Template variables of the dashboard. Every query filters on job and instance.
const (
	varDatasource = "datasource"
	varJob        = "job"
	varInstance   = "instance"
)

// The datasource every panel and query uses: the one the datasource variable picks.
var promDS = common.DataSourceRef{Type: ptr("prometheus"), Uid: ptr("${" + varDatasource + "}")}

// sel is the selector of metric restricted to the chosen jobs and instances.
func sel(metric string) string {
	return fmt.Sprintf(`%s{job=~"$%s", instance=~"$%s"}`, metric, varJob, varInstance)
}

// rate is the per-second rate of a counter over Grafana's rate interval.
func rate(metric string) string {
	return fmt.Sprintf("rate(%s[$__rate_interval])", sel(metric))
}

// quantiles returns the p50, p90 and p99 queries of a histogram, split by the given labels.
func quantiles(histogram string, by ...string) []query {
	var out []query
	groupBy := strings.Join(append(append([]string{}, by...), "le"), ", ")
	legend := ""
	for _, l := range by {
		legend += "{{" + l + "}} "
	}
	for _, q := range []string{"0.5", "0.9", "0.99"} {
		out = append(out, query{
			expr:   fmt.Sprintf("histogram_quantile(%s, sum by (%s) (%s))", q, groupBy, rate(histogram+"_bucket")),
			legend: legend + "p" + strings.TrimPrefix(q, "0."),
		})
	}
	return out
}

type query struct{ expr, legend string }

// Dashboard returns the Grafana dashboard of Spiegel for NATS: producer, queue, jobs, on_change,
// replication and processes, over the metrics of pkg/metrics and pkg/health. No query uses a
// label carrying a db name (the service exports none).
func Dashboard() (dashboard.Dashboard, error) {
	b := dashboard.NewDashboardBuilder("Spiegel for NATS").
		Uid(DashboardUID).
		Description("CouchDB _db_updates → JetStream work queue → replicator and onchange consumers. "+
			"What to watch and what the alerts mean: deployments/README.md, \"Day two\".").
		Tags([]string{"spiegel", "couchdb", "nats"}).
		Editable().
		Tooltip(dashboard.DashboardCursorSyncCrosshair).
		Refresh("30s").
		Time("now-6h", "now").
		Timezone(common.TimeZoneBrowser).
		WithVariable(dashboard.NewDatasourceVariableBuilder(varDatasource).
			Label("Data source").
			Type("prometheus")).
		WithVariable(labelVariable(varJob, "Job", "spiegel_build_info")).
		WithVariable(labelVariable(varInstance, "Instance", fmt.Sprintf(`spiegel_build_info{job=~"$%s"}`, varJob)))

	p := &panels{b: b}

	p.row("Overview")
	p.add(statPanel("Pending jobs", "Jobs waiting for a worker, all groups. Every process reports the queue; the max is its depth.",
		"short", 1000, 10000,
		query{fmt.Sprintf("sum(max by (group) (%s))", sel("spiegel_jobs_pending")), "pending"}))
	p.add(statPanel("Feed position age", "Longest time since a producer's saved feed position moved or was confirmed current. "+
		"Alert SpiegelFeedPositionStale fires above 5 minutes.",
		"s", 60, 300,
		query{fmt.Sprintf("max(%s)", sel("spiegel_feed_position_age_seconds")), "age"}))
	p.add(statPanel("Dead letters (24 h)", "Dead-letter records written in the last 24 hours (stream SPIEGEL_DEADLETTER).",
		"short", 1, 100,
		query{fmt.Sprintf("sum(increase(%s[24h]))", sel("spiegel_dead_letters_total")), "dead letters"}))
	p.add(statPanel("Checks failing", "Readiness checks failing now, over all processes (spiegel_ready == 0).",
		"short", 1, 1,
		query{fmt.Sprintf("count(%s == 0) or vector(0)", sel("spiegel_ready")), "failing"}))

	p.row("Producer")
	p.add(graph("Jobs published and deduplicated", "Jobs the work stream accepted, and publishes it refused because "+
		"a job for the same (group, db) was pending: a burst of writes to one db collapses into one job.",
		"ops",
		query{fmt.Sprintf("sum by (group) (%s)", rate("spiegel_jobs_published_total")), "published {{group}}"},
		query{fmt.Sprintf("sum by (group) (%s)", rate("spiegel_jobs_deduplicated_total")), "deduplicated {{group}}"}))
	p.add(graph("Feed events and sweep", "Db-update events read from the feed by type, and dbs the reconciliation "+
		"sweep enqueued: not recorded done at their update_seq (events _db_updates dropped, jobs NATS lost). "+
		"On a CouchDB cluster, the sweep's _changes reads for dbs whose record names other shard copies, by answer.",
		"ops",
		query{fmt.Sprintf("sum by (type) (%s)", rate("spiegel_feed_events_total")), "{{type}}"},
		query{fmt.Sprintf("sum(%s)", rate("spiegel_sweep_dbs_total")), "sweep"},
		query{fmt.Sprintf("sum by (then) (%s)", rate("spiegel_sweep_checks_total")), "sweep check {{then}}"}))
	p.add(graph("Feed position age", "Seconds since each producer's saved position moved or was confirmed current. "+
		"A few seconds is normal; a steady climb means the producer cannot publish or save.",
		"s",
		query{fmt.Sprintf("max by (job, instance) (%s)", sel("spiegel_feed_position_age_seconds")), "{{instance}}"}).
		Thresholds(thresholds(300, 300)).
		ThresholdsStyle(common.NewGraphThresholdsStyleConfigBuilder().Mode(common.GraphThresholdsStyleModeLine)))
	p.add(graph("Feed and publish errors", "Feed or rule-feed errors (every process follows the rules; the producer "+
		"also the db updates) and job publishes retried. Both are retried: sustained values are what matter.",
		"ops",
		query{fmt.Sprintf("sum by (job, instance) (%s)", rate("spiegel_feed_errors_total")), "feed {{instance}}"},
		query{fmt.Sprintf("sum by (group) (%s)", rate("spiegel_publish_errors_total")), "publish {{group}}"}))
	p.add(graph("Hot feeds", "Continuous _changes feeds open on recently changed dbs (SPIEGEL_HOT_FEEDS), publishes "+
		"of jobs on changes they delivered, and db-update events passed over because a hot feed covers the db. "+
		"Open feeds pinned at SPIEGEL_HOT_FEEDS mean more dbs are busy than feeds allowed: the rest wait for _db_updates.",
		"short",
		query{fmt.Sprintf("sum by (job, instance) (%s)", sel("spiegel_hot_feeds")), "open {{instance}}"},
		query{fmt.Sprintf("sum(%s)", rate("spiegel_hot_feed_publishes_total")), "publishes/s"},
		query{fmt.Sprintf("sum(%s)", rate("spiegel_feed_events_covered_total")), "events passed over/s"},
		query{fmt.Sprintf("max by (instance) (%s)", sel("spiegel_hot_feed_streak")), "events in a row that earn a feed {{instance}}"}))
	p.add(graph("Hot feeds opened and closed", "Feeds opened for dbs whose writes earned one (three db-update events "+
		"in a row within SPIEGEL_HOT_FEED_IDLE, up to eight while feeds do not pay: spiegel_hot_feed_streak), busy dbs "+
		"refused a feed at the cap, feeds closed by reason, and deleted dbs whose cached on_change checkpoints were "+
		"dropped. Opens per written doc should stay small: a feed that opens and closes often does not pay for its connection.",
		"ops",
		query{fmt.Sprintf("sum(%s)", rate("spiegel_hot_feeds_opened_total")), "opened"},
		query{fmt.Sprintf("sum(%s)", rate("spiegel_hot_feeds_refused_total")), "refused at the cap"},
		query{fmt.Sprintf("sum by (reason) (%s)", rate("spiegel_hot_feeds_closed_total")), "closed {{reason}}"},
		query{fmt.Sprintf("sum(%s)", rate("spiegel_deleted_db_checkpoints_dropped_total")), "deleted dbs' checkpoints dropped"}))
	p.add(graph("Rules", "Valid rules loaded by kind, and rule docs rejected as invalid (producer status lists why).",
		"short",
		query{fmt.Sprintf("max by (kind) (%s)", sel("spiegel_rules_loaded")), "{{kind}}"},
		query{fmt.Sprintf("max(%s)", sel("spiegel_rules_rejected")), "rejected"}))

	p.row("Queue and jobs")
	p.add(graph("Pending jobs", "Jobs waiting for a worker, per group (at most one per group and db). "+
		"Consumers scale on this number.",
		"short",
		query{fmt.Sprintf("max by (group) (%s)", sel("spiegel_jobs_pending")), "{{group}}"}))
	p.add(graph("Jobs in flight", "Jobs delivered to a worker and not yet acknowledged, per group.",
		"short",
		query{fmt.Sprintf("max by (group) (%s)", sel("spiegel_jobs_in_flight")), "{{group}}"}))
	p.add(graph("Jobs by result", "Jobs run per group and result: ok; retry (failed, redelivered later); "+
		"delayed (dirty_after_milliseconds); failed (given up).",
		"ops",
		query{fmt.Sprintf("sum by (group, result) (%s)", rate("spiegel_jobs_total")), "{{group}} {{result}}"}))
	p.add(graph("Job duration", "How long a job's handler ran: p50, p90 and p99 per group.",
		"s", quantiles("spiegel_job_duration_seconds", "group")...))
	p.add(graph("Dead letters", "Dead-letter records written per group. Read them with "+
		"nats stream view SPIEGEL_DEADLETTER; see deployments/README.md, SpiegelDeadLetters.",
		"short",
		query{fmt.Sprintf("sum by (group) (increase(%s[$__rate_interval]))", sel("spiegel_dead_letters_total")), "{{group}}"}).
		DrawStyle(common.GraphDrawStyleBars))

	p.row("on_change")
	p.add(graph("Webhook requests by status class", "Webhook calls of on_change rules per status class "+
		"(2xx, 3xx, 4xx, 5xx; error: no answer).",
		"reqps",
		query{fmt.Sprintf("sum by (class) (%s)", rate("spiegel_webhook_requests_total")), "{{class}}"}))
	p.add(graph("Webhook latency", "Webhook request duration per status class: p50, p90 and p99.",
		"s", quantiles("spiegel_webhook_request_duration_seconds", "class")...))
	p.add(graph("Changes published to NATS", "Changes published by on_change rules with a subject, "+
		"and gaps found in what readers consume: our changes stream lacks messages a rule stored (subject), a mirror bucket lost a write (mirror).",
		"ops",
		query{fmt.Sprintf("sum(%s)", rate("spiegel_changes_published_total")), "published"},
		query{fmt.Sprintf("sum by (kind) (%s)", rate("spiegel_output_gaps_total")), "gaps {{kind}}"},
		query{fmt.Sprintf("sum(%s)", rate("spiegel_change_stream_losses_total")), "changes stream losses"}))
	p.add(graph("Stream replicas behind", "Replicas of each of Spiegel's streams that are offline or not current, as the "+
		"stream's leader reports them (SpiegelStreamReplicaBehind). Spiegel never changes replicas: see the runbook.",
		"short",
		query{fmt.Sprintf("max by (stream) (%s)", sel("spiegel_stream_replicas_behind")), "{{stream}}"}))

	p.row("Replication")
	p.add(graph("Replications by engine and result", "Replications of one rule and db: ok, error, missing_source; "+
		"engine couchdb (POST /_replicate) or native.",
		"ops",
		query{fmt.Sprintf("sum by (engine, result) (%s)", rate("spiegel_replications_total")), "{{engine}} {{result}}"}))
	p.add(graph("Docs written", "Docs written to targets by replications.",
		"wps",
		query{fmt.Sprintf("sum(%s)", rate("spiegel_replication_docs_written_total")), "docs"}))
	p.add(graph("Replication duration", "Duration of one replication: p50, p90 and p99.",
		"s", quantiles("spiegel_replication_duration_seconds")...))

	p.row("Processes")
	p.add(readiness())
	p.add(graph("CPU", "CPU time used per process (cores).",
		"short",
		query{fmt.Sprintf("sum by (job, instance) (%s)", rate("process_cpu_seconds_total")), "{{job}} {{instance}}"}))
	p.add(graph("Resident memory", "Resident set size per process.",
		"bytes",
		query{fmt.Sprintf("sum by (job, instance) (%s)", sel("process_resident_memory_bytes")), "{{job}} {{instance}}"}))

	if p.err != nil {
		return dashboard.Dashboard{}, p.err
	}
	return b.Build()
}

// DashboardJSON is the dashboard as committed in grafana/spiegel.json: indented, with a final
// newline.
func DashboardJSON() ([]byte, error) {
	d, err := Dashboard()
	if err != nil {
		return nil, fmt.Errorf("build the dashboard: %w", err)
	}
	out, err := json.MarshalIndent(d, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("encode the dashboard: %w", err)
	}
	return append(out, '\n'), nil
}

// panels adds rows and panels to a dashboard with stable ids (1, 2, …) in order.
type panels struct {
	b      *dashboard.DashboardBuilder
	nextID uint32
	err    error
}

func (p *panels) id() uint32 {
	p.nextID++
	return p.nextID
}

func (p *panels) row(title string) {
	p.b.WithRow(dashboard.NewRowBuilder(title).Id(p.id()))
}

// panelBuilder is what the panel builders of the SDK have in common here.
type panelBuilder interface {
	cog.Builder[dashboard.Panel]
}

func (p *panels) add(pb panelBuilder) {
	switch b := pb.(type) {
	case *timeseries.PanelBuilder:
		b.Id(p.id())
	case *stat.PanelBuilder:
		b.Id(p.id())
	case *statetimeline.PanelBuilder:
		b.Id(p.id())
	default:
		p.err = fmt.Errorf("panel builder %T: give it an id", pb)
		return
	}
	p.b.WithPanel(pb)
}

func targets(qs []query) []cog.Builder[variants.Dataquery] {
	out := make([]cog.Builder[variants.Dataquery], 0, len(qs))
	for i, q := range qs {
		out = append(out, prometheus.NewDataqueryBuilder().
			Datasource(promDS).
			RefId(string(rune('A'+i))).
			Expr(q.expr).
			LegendFormat(q.legend).
			Range())
	}
	return out
}

// graph is a time series panel, a third of the width.
func graph(title, description, unit string, qs ...query) *timeseries.PanelBuilder {
	return timeseries.NewPanelBuilder().
		Title(title).
		Description(description).
		Datasource(promDS).
		Targets(targets(qs)).
		Unit(unit).
		Min(0).
		Height(8).
		Span(8).
		FillOpacity(10).
		ShowPoints(common.VisibilityModeNever).
		Legend(common.NewVizLegendOptionsBuilder().
			DisplayMode(common.LegendDisplayModeList).
			Placement(common.LegendPlacementBottom).
			ShowLegend(true)).
		Tooltip(common.NewVizTooltipOptionsBuilder().
			Mode(common.TooltipDisplayModeMulti).
			Sort(common.SortOrderDescending))
}

// statPanel is a stat panel, a quarter of the width, yellow from warn and red from crit.
func statPanel(title, description, unit string, warn, crit float64, q query) *stat.PanelBuilder {
	return stat.NewPanelBuilder().
		Title(title).
		Description(description).
		Datasource(promDS).
		Targets(targets([]query{q})).
		Unit(unit).
		Height(4).
		Span(6).
		Thresholds(thresholds(warn, crit)).
		ColorMode(common.BigValueColorModeValue).
		GraphMode(common.BigValueGraphModeArea).
		ReduceOptions(common.NewReduceDataOptionsBuilder().Calcs([]string{"lastNotNull"}))
}

// readiness shows spiegel_ready{check} (1 ready, 0 not) and the scrape's up per process.
func readiness() *statetimeline.PanelBuilder {
	return statetimeline.NewPanelBuilder().
		Title("Readiness").
		Description("Each process's readiness checks (spiegel_ready: couchdb, nats, stream or consumer, feed), as " +
			"/readyz evaluates them, and whether Prometheus could scrape it (up).").
		Datasource(promDS).
		Targets(targets([]query{
			{fmt.Sprintf("min by (job, instance, check) (%s)", sel("spiegel_ready")), "{{instance}} {{check}}"},
			{sel("up"), "{{instance}} scrape"},
		})).
		Height(8).
		Span(8).
		ShowValue(common.VisibilityModeNever).
		MergeValues(true).
		Mappings([]dashboard.ValueMapping{{ValueMap: &dashboard.ValueMap{
			Type: dashboard.MappingTypeValueToText,
			Options: map[string]dashboard.ValueMappingResult{
				"0": {Text: ptr("not ready"), Color: ptr("red")},
				"1": {Text: ptr("ready"), Color: ptr("green")},
			},
		}}}).
		Thresholds(dashboard.NewThresholdsConfigBuilder().Mode(dashboard.ThresholdsModeAbsolute).Steps([]dashboard.Threshold{
			{Value: nil, Color: "red"}, {Value: ptr(1.0), Color: "green"},
		})).
		Tooltip(common.NewVizTooltipOptionsBuilder().Mode(common.TooltipDisplayModeSingle).Sort(common.SortOrderNone))
}

// thresholds colours green below warn, yellow from warn, red from crit (equal: no yellow).
func thresholds(warn, crit float64) *dashboard.ThresholdsConfigBuilder {
	steps := []dashboard.Threshold{{Value: nil, Color: "green"}}
	if warn < crit {
		steps = append(steps, dashboard.Threshold{Value: ptr(warn), Color: "yellow"})
	}
	steps = append(steps, dashboard.Threshold{Value: ptr(crit), Color: "red"})
	return dashboard.NewThresholdsConfigBuilder().Mode(dashboard.ThresholdsModeAbsolute).Steps(steps)
}

// labelVariable is a multi-value query variable over the values of label job or instance of the
// processes that export spiegel_build_info (every Spiegel process does).
func labelVariable(name, label, selector string) *dashboard.QueryVariableBuilder {
	q := fmt.Sprintf("label_values(%s, %s)", selector, name)
	return dashboard.NewQueryVariableBuilder(name).
		Label(label).
		Datasource(promDS).
		Query(dashboard.StringOrMap{String: ptr(q)}).
		Definition(q).
		Refresh(dashboard.VariableRefreshOnTimeRangeChanged).
		Sort(dashboard.VariableSortAlphabeticalAsc).
		Multi(true).
		IncludeAll(true).
		AllValue(".*")
}

func ptr[T any](v T) *T { return &v }

package status

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/spiegel-nats/spiegel/pkg/events"
)

// Config describes the service of one process.
type Config struct {
	// Prefix is SPIEGEL_SUBJECT_PREFIX: the service's name and subject derive from it, so that
	// two installations on one NATS do not mix.
	Prefix string
	// Component is ComponentProducer, ComponentReplicator or ComponentOnChange.
	Component string
	// Version is the build's version (config.Version); see SemVer.
	Version string
	// Report fills the process's own parts of an answer (the service sets Service, Component,
	// ID, Version, Host and Started). It is called for every request on a NATS goroutine: it
	// must be quick, must not block, and must put nothing secret into the Report.
	Report func(*Report)
}

// Service is the registration of one process. Stop it before the connection is drained.
type Service struct {
	svc micro.Service
	id  atomic.Value // string: the instance id, once registered
}

// ServiceName is the micro service name of component: "<prefix>-<component>", e.g.
// spiegel-producer, with every byte of the prefix outside [A-Za-z0-9_-] (such as the dots of
// "acme.spiegel") replaced by "_", as micro allows no others.
func ServiceName(prefix, component string) string {
	p := events.NewSubjects(prefix).Prefix
	p = strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-' {
			return r
		}
		return '_'
	}, p)
	return p + "-" + component
}

// StatusSubject is the subject of component's status endpoint: "<prefix>.svc.<component>.status".
// Every instance of the component answers a request on it (no queue group).
func StatusSubject(prefix, component string) string {
	return events.NewSubjects(prefix).Prefix + ".svc." + component + ".status"
}

// semVerRE is micro's own check of a service version (semver.org's suggested expression).
var semVerRE = regexp.MustCompile(`^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$`)

// SemVer returns version as micro wants it: "v1.2.3" is "1.2.3"; a version that is not SemVer
// (a development build's "dev", a commit hash) is "0.0.0+<version>" with every byte outside
// [0-9A-Za-z-] replaced by "-".
func SemVer(version string) string {
	v := strings.TrimPrefix(version, "v")
	if semVerRE.MatchString(v) {
		return v
	}
	meta := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' {
			return r
		}
		return '-'
	}, version)
	if meta == "" {
		meta = "unknown"
	}
	return "0.0.0+" + meta
}

// Register adds the process's micro service on nc: name ServiceName, version SemVer(Version),
// one endpoint "status" on StatusSubject answering a Report as JSON. The framework's own
// subjects ($SRV.PING, $SRV.INFO, $SRV.STATS) then list it, so `nats micro list`, `info` and
// `stats` show every running process. The service stops with the connection, or with Stop.
func Register(nc *nats.Conn, c Config) (*Service, error) {
	host, _ := os.Hostname()
	started := time.Now().UTC()
	name := ServiceName(c.Prefix, c.Component)
	s := &Service{}
	answer := func() Report {
		var rep Report
		if c.Report != nil {
			c.Report(&rep)
		}
		rep.Service, rep.Component, rep.Version, rep.Host, rep.Started = name, c.Component, c.Version, host, started
		rep.ID, _ = s.id.Load().(string)
		return rep
	}
	svc, err := micro.AddService(nc, micro.Config{
		Name:        name,
		Version:     SemVer(c.Version),
		Description: fmt.Sprintf("Spiegel for NATS %s (subject prefix %s)", c.Component, events.NewSubjects(c.Prefix).Prefix),
		Metadata: map[string]string{
			"component": c.Component, "prefix": events.NewSubjects(c.Prefix).Prefix, "version": c.Version, "host": host,
		},
		// What `nats micro stats` shows besides the request counts of the status endpoint.
		StatsHandler: func(*micro.Endpoint) any {
			rep := answer()
			return map[string]any{"jobs_in_flight": rep.InFlight, "rules": rep.Rules, "last_error": rep.LastError}
		},
	})
	if err != nil {
		return nil, fmt.Errorf("register NATS service %s: %w", name, err)
	}
	s.svc = svc
	s.id.Store(svc.Info().ID)
	err = svc.AddEndpoint("status", micro.HandlerFunc(func(req micro.Request) {
		data, err := json.Marshal(answer())
		if err != nil {
			_ = req.Error("500", "encode status", nil)
			return
		}
		_ = req.Respond(data)
	}), micro.WithEndpointSubject(StatusSubject(c.Prefix, c.Component)), micro.WithEndpointQueueGroupDisabled())
	if err != nil {
		_ = svc.Stop()
		return nil, fmt.Errorf("register NATS service %s: endpoint status: %w", name, err)
	}
	return s, nil
}

// ID returns the service instance's id.
func (s *Service) ID() string { return s.svc.Info().ID }

// Stop removes the service's subscriptions.
func (s *Service) Stop() error { return s.svc.Stop() }

// collectQuiet is how long Collect waits for more answers after the last one.
const collectQuiet = 300 * time.Millisecond

// Collect asks every running instance of every component of the installation with prefix for
// its Report, on one reply subject, and returns the answers sorted by component and id. Answers
// come within milliseconds: Collect returns once none came for 300 ms after the last one, at the
// latest after wait (or when ctx ends) — with no instance running, after wait. Answers that do
// not decode are skipped. It fails only when the requests cannot be sent.
func Collect(ctx context.Context, nc *nats.Conn, prefix string, wait time.Duration) ([]Report, error) {
	inbox := nc.NewRespInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		return nil, fmt.Errorf("ask for the status of the running processes: %w", err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	for _, c := range Components {
		if err := nc.PublishRequest(StatusSubject(prefix, c), inbox, nil); err != nil {
			return nil, fmt.Errorf("ask for the status of the running processes: %w", err)
		}
	}
	deadline := time.Now().Add(wait)
	fctx, cancel := context.WithDeadline(ctx, deadline)
	err = nc.FlushWithContext(fctx)
	cancel()
	if err != nil && ctx.Err() == nil {
		return nil, fmt.Errorf("ask for the status of the running processes: %w", err)
	}
	var out []Report
	for {
		until := deadline
		if q := time.Now().Add(collectQuiet); len(out) > 0 && q.Before(deadline) {
			until = q
		}
		wctx, cancel := context.WithDeadline(ctx, until)
		msg, err := sub.NextMsgWithContext(wctx)
		cancel()
		if errors.Is(err, nats.ErrNoResponders) {
			continue // no instance of one component runs
		}
		if err != nil {
			if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
				break
			}
			return nil, fmt.Errorf("read the status of the running processes: %w", err)
		}
		var rep Report
		if json.Unmarshal(msg.Data, &rep) == nil && rep.ID != "" {
			out = append(out, rep)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Component != out[j].Component {
			return componentOrder(out[i].Component) < componentOrder(out[j].Component)
		}
		return out[i].ID < out[j].ID
	})
	return out, nil
}

func componentOrder(c string) int {
	for i, x := range Components {
		if x == c {
			return i
		}
	}
	return len(Components)
}

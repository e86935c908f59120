// Package admin is what the producer binary's admin commands do to an installation (producer/
// parses their flags and prints their results): connect to CouchDB and NATS with a clear word
// per problem, install and uninstall, enqueue matched dbs, read and re-drive dead letters, reset
// checkpoints for a replay and count what it stored, and gather the status report.
package admin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/logging"
	"github.com/spiegel-nats/spiegel/pkg/natsjs"
	"github.com/spiegel-nats/spiegel/pkg/producer"
)

// defaultAdminTimeout bounds the admin commands' wait for CouchDB and NATS when the
// configuration does not say (SPIEGEL_ADMIN_TIMEOUT, --timeout).
const defaultAdminTimeout = 15 * time.Second

// ServerProblems are the problems an admin command found with its servers, one sentence each
// (Connect).
type ServerProblems []string

func (p ServerProblems) Error() string { return strings.Join(p, "\n") }

// Connect connects an admin command to CouchDB and NATS: unlike the daemon, which waits for its
// servers for as long as it takes (and says so on /readyz), an admin command checks CouchDB and
// NATS at once, for at most cfg.AdminTimeout, and fails with one sentence per problem it found
// (ServerProblems) — which server, at which URL (without its password), what it answered.
func Connect(ctx context.Context, cfg *config.Producer, log *logrus.Logger, maxPending int) (*producer.Conns, error) {
	timeout := cfg.AdminTimeout
	if timeout <= 0 {
		timeout = defaultAdminTimeout
	}
	cc, err := producer.NewCouch(cfg, log)
	if err != nil {
		return nil, err
	}
	pctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var wg sync.WaitGroup
	var couchProblem, natsProblem string
	var nc *nats.Conn
	wg.Go(func() { couchProblem = checkCouch(pctx, cc, cfg.CouchDBURL, timeout) })
	wg.Go(func() { nc, natsProblem = checkNATS(pctx, cfg, timeout) })
	wg.Wait()
	var problems ServerProblems
	for _, p := range []string{couchProblem, natsProblem} {
		if p != "" {
			problems = append(problems, p)
		}
	}
	if ctx.Err() != nil {
		problems = nil // interrupted: say that, not what the cut-short checks saw
	}
	if len(problems) > 0 || ctx.Err() != nil {
		if nc != nil {
			nc.Close()
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, problems
	}
	return producer.NewConns(cfg, log, cc, nc, maxPending)
}

// checkCouch returns what is wrong with the CouchDB at rawURL ("" when it answers as it should).
func checkCouch(ctx context.Context, cc *couch.Client, rawURL string, timeout time.Duration) string {
	where := "CouchDB at " + cc.Redacted()
	_, err := cc.Server(ctx)
	if err == nil {
		return ""
	}
	var he *couch.HTTPError
	switch {
	case errors.As(err, &he) && (he.Status == http.StatusUnauthorized || he.Status == http.StatusForbidden):
		user := "no user"
		if i := strings.Index(rawURL, "://"); i >= 0 {
			if at := strings.LastIndex(rawURL[i+3:], "@"); at >= 0 {
				name, _, _ := strings.Cut(rawURL[i+3:i+3+at], ":")
				user = "user " + strings.TrimSpace(name)
			}
		}
		return fmt.Sprintf("%s refused the credentials (%s): %d %s", where, user, he.Status, redactedReason(he))
	case errors.As(err, &he):
		return fmt.Sprintf("%s answered %d %s", where, he.Status, redactedReason(he))
	case errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil:
		return fmt.Sprintf("%s did not answer within %s", where, timeout)
	default:
		return fmt.Sprintf("%s is not reachable: %s", where, logging.RedactText(rootCause(err).Error()))
	}
}

// checkNATS connects to NATS and checks that JetStream answers; it returns the connection, or
// what is wrong.
func checkNATS(ctx context.Context, cfg *config.Producer, timeout time.Duration) (*nats.Conn, string) {
	where := "NATS at " + logging.RedactText(cfg.NATSURL)
	quiet := logrus.New()
	quiet.SetOutput(io.Discard)
	nc, err := natsjs.Connect(ctx, natsjs.OptionsFrom(cfg.NATS, "spiegel-producer"), quiet)
	if err != nil {
		msg := logging.RedactText(err.Error())
		if _, after, ok := strings.Cut(msg, ": "); ok && strings.HasPrefix(msg, "connect to NATS at ") {
			msg = after
		}
		if ctx.Err() != nil {
			return nil, fmt.Sprintf("%s is not reachable within %s: %s", where, timeout, msg)
		}
		return nil, fmt.Sprintf("%s refused the connection: %s", where, msg)
	}
	js, err := jetstream.New(nc)
	if err == nil {
		_, err = js.AccountInfo(ctx)
	}
	switch {
	case err == nil:
		return nc, ""
	case errors.Is(err, jetstream.ErrJetStreamNotEnabled), errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount):
		nc.Close()
		return nil, where + " has no JetStream: start nats-server with -js (or enable JetStream for the account)"
	default:
		nc.Close()
		return nil, fmt.Sprintf("%s: JetStream did not answer within %s: %s", where, timeout, logging.RedactText(err.Error()))
	}
}

// redactedReason is the server's own words of he ("unauthorized: Name or password is
// incorrect."), without secrets.
func redactedReason(he *couch.HTTPError) string {
	s := he.ErrorName
	if s == "" {
		s = http.StatusText(he.Status)
	}
	if he.Reason != "" {
		s += ": " + he.Reason
	}
	return logging.RedactText(s)
}

// rootCause unwraps err to its innermost error (e.g. "connection refused").
func rootCause(err error) error {
	for {
		next := errors.Unwrap(err)
		if next == nil {
			return err
		}
		err = next
	}
}

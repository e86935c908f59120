// Package natsjs connects to NATS and owns the JetStream topology of SPEC §3: the work stream and
// its durable consumers, the dead-letter and changes streams, and publishing jobs into them.
package natsjs

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// Options says how to reach NATS. Only URLs is required; the rest are the usual NATS
// authentication and TLS settings, used when set.
type Options struct {
	URLs         string // comma-separated
	Name         string // connection name shown by the server
	CredsFile    string
	NKeySeedFile string
	User         string
	Password     string
	Token        string
	CAFile       string
	CertFile     string
	KeyFile      string
	// ConnectTimeout bounds the first connection; 0 → 10s.
	ConnectTimeout time.Duration
}

// Connect dials NATS and keeps reconnecting forever after a connection loss (the service never
// exits on a NATS outage). The first connection is retried until ctx ends, so a process started
// before NATS waits for it.
func Connect(ctx context.Context, o Options, log logrus.FieldLogger) (*nats.Conn, error) {
	if strings.TrimSpace(o.URLs) == "" {
		return nil, errors.New("connect to NATS: no server URL")
	}
	opts := []nats.Option{
		nats.Name(o.Name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectJitter(250*time.Millisecond, time.Second),
		nats.RetryOnFailedConnect(false),
		nats.PingInterval(10 * time.Second),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.WithError(err).Warn("disconnected from NATS")
			}
		}),
		nats.ReconnectHandler(func(c *nats.Conn) {
			log.WithField("server", logging.RedactURL(c.ConnectedUrl())).Info("reconnected to NATS")
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			log.WithError(err).Warn("NATS error")
		}),
	}
	if o.ConnectTimeout > 0 {
		opts = append(opts, nats.Timeout(o.ConnectTimeout))
	}
	if o.CredsFile != "" {
		opts = append(opts, nats.UserCredentials(o.CredsFile))
	}
	if o.NKeySeedFile != "" {
		opt, err := nats.NkeyOptionFromSeed(o.NKeySeedFile)
		if err != nil {
			return nil, fmt.Errorf("read NATS nkey seed file %s: %w", o.NKeySeedFile, err)
		}
		opts = append(opts, opt)
	}
	if o.User != "" {
		opts = append(opts, nats.UserInfo(o.User, o.Password))
	}
	if o.Token != "" {
		opts = append(opts, nats.Token(o.Token))
	}
	if o.CAFile != "" {
		opts = append(opts, nats.RootCAs(o.CAFile))
	}
	if o.CertFile != "" || o.KeyFile != "" {
		if o.CertFile == "" || o.KeyFile == "" {
			return nil, errors.New("connect to NATS: a client certificate needs both the cert and the key file")
		}
		opts = append(opts, nats.ClientCert(o.CertFile, o.KeyFile))
	}
	attempt := 0
	for {
		nc, err := nats.Connect(o.URLs, opts...)
		if err == nil {
			return nc, nil
		}
		attempt++
		redacted := logging.RedactText(err.Error())
		if isPermanentConnectError(err) {
			return nil, fmt.Errorf("connect to NATS at %s: %s", logging.RedactText(o.URLs), redacted)
		}
		log.WithField("attempt", attempt).WithField("error", redacted).Warn("NATS not reachable yet, retrying")
		if err := sleep(ctx, attempt); err != nil {
			return nil, fmt.Errorf("connect to NATS at %s: %s", logging.RedactText(o.URLs), redacted)
		}
	}
}

func isPermanentConnectError(err error) bool {
	return errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) ||
		errors.Is(err, nats.ErrNkeysNotSupported) || strings.Contains(err.Error(), "tls:") ||
		strings.Contains(err.Error(), "no such file")
}

func sleep(ctx context.Context, attempt int) error {
	d := time.Duration(attempt) * 250 * time.Millisecond
	if d > 5*time.Second {
		d = 5 * time.Second
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

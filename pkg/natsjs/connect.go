// Package natsjs connects to NATS and owns the JetStream topology of SPEC §3: the work stream and
// its durable consumers, the dead-letter and changes streams, and publishing jobs into them.
package natsjs

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/backoff"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/logging"
)

// connectRetry paces the attempts of the first connection.
var connectRetry = backoff.Policy{Initial: 250 * time.Millisecond, Max: 5 * time.Second, Multiplier: 2, Jitter: 0.2}

// OptionsFrom returns the options of a connection named name from the configuration.
func OptionsFrom(c config.NATS, name string) Options {
	return Options{
		URLs: c.NATSURL, Name: name, CredsFile: c.NATSCredsFile, NKeySeedFile: c.NATSNKeySeedFile,
		User: c.NATSUser, Password: c.NATSPassword, Token: c.NATSToken,
		CAFile: c.NATSCAFile, CertFile: c.NATSCertFile, KeyFile: c.NATSKeyFile,
	}
}

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
	// ConnectTimeout bounds one connection attempt (dial and handshake); 0 → nats.go's 2s.
	ConnectTimeout time.Duration
	// NoReconnectBuffer makes every publish fail at once while the connection is down, instead
	// of being buffered (nats.go keeps up to 8 MB) and sent after the reconnect, when whoever
	// made it may have lost the job it was for. Consumers set it: a job's side effects (its
	// publishes, checkpoint writes, lease renewals) must reach NATS while the job is held, or
	// not at all.
	NoReconnectBuffer bool
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
	if o.NoReconnectBuffer {
		opts = append(opts, nats.ReconnectBufSize(-1))
	}
	if o.ConnectTimeout > 0 {
		opts = append(opts, nats.Timeout(o.ConnectTimeout))
	}
	if o.CredsFile != "" {
		opt := nats.UserCredentials(o.CredsFile)
		if err := checkOption(opt); err != nil {
			return nil, fmt.Errorf("read NATS creds file %s: %w", o.CredsFile, err)
		}
		opts = append(opts, opt)
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
		opt := nats.RootCAs(o.CAFile)
		if err := checkOption(opt); err != nil {
			return nil, fmt.Errorf("read NATS CA file %s: %w", o.CAFile, err)
		}
		opts = append(opts, opt)
	}
	if o.CertFile != "" || o.KeyFile != "" {
		if o.CertFile == "" || o.KeyFile == "" {
			return nil, errors.New("connect to NATS: a client certificate needs both the cert and the key file")
		}
		opt := nats.ClientCert(o.CertFile, o.KeyFile)
		if err := checkOption(opt); err != nil {
			return nil, fmt.Errorf("read NATS client certificate %s and key %s: %w", o.CertFile, o.KeyFile, err)
		}
		opts = append(opts, opt)
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
		if err := backoff.Sleep(ctx, connectRetry.Delay(attempt)); err != nil {
			return nil, fmt.Errorf("connect to NATS at %s: %s", logging.RedactText(o.URLs), redacted)
		}
	}
}

// checkOption applies opt to scratch options and, for credentials, reads the JWT and signs a
// nonce, so that a missing or unparsable file is reported at once instead of at every connection
// attempt, where it would be retried as if NATS were down.
func checkOption(opt nats.Option) error {
	scratch := nats.GetDefaultOptions()
	if err := opt(&scratch); err != nil {
		return err
	}
	if scratch.UserJWT != nil {
		if _, err := scratch.UserJWT(); err != nil {
			return err
		}
	}
	if scratch.SignatureCB != nil {
		if _, err := scratch.SignatureCB([]byte("nonce")); err != nil {
			return err
		}
	}
	return nil
}

// isPermanentConnectError tells a misconfiguration (credentials, TLS setup) from NATS not being
// reachable yet: the first is reported, the second retried. A TLS handshake that times out counts
// as not reachable.
func isPermanentConnectError(err error) bool {
	var netErr net.Error
	if errors.As(err, &netErr) && netErr.Timeout() {
		return false
	}
	for _, permanent := range []error{
		nats.ErrAuthorization, nats.ErrAuthExpired, nats.ErrAuthRevoked, nats.ErrAccountAuthExpired,
		nats.ErrNkeysNotSupported, nats.ErrTLS, nats.ErrSecureConnWanted, nats.ErrSecureConnRequired,
		fs.ErrNotExist, fs.ErrPermission,
	} {
		if errors.Is(err, permanent) {
			return true
		}
	}
	return strings.Contains(err.Error(), "tls:")
}

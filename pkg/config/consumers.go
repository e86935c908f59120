package config

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"time"
)

// Consumer is what both consumer binaries share.
type Consumer struct {
	CouchDB
	NATS
	Log
	Debug
	Concurrency   int           `envconfig:"SPIEGEL_CONCURRENCY" default:"20" desc:"jobs one consumer process runs at once" group:"Jobs"`
	PasswordsFile string        `envconfig:"SPIEGEL_PASSWORDS_FILE" desc:"JSON passwords file {\"host\": {\"user\": \"password\"}}; reloaded on SIGHUP" group:"Process"`
	ShutdownGrace time.Duration `envconfig:"SPIEGEL_SHUTDOWN_GRACE" default:"20s" desc:"on SIGTERM, how long running jobs may take to finish before they are handed back" group:"Process" advanced:"true"`
	RetryInitial  time.Duration `envconfig:"SPIEGEL_RETRY_INITIAL" default:"1s" desc:"first redelivery delay of a job that failed transiently" group:"Jobs" advanced:"true"`
	RetryMax      time.Duration `envconfig:"SPIEGEL_RETRY_MAX" default:"5m" desc:"cap of the redelivery delay of a job that keeps failing" group:"Jobs" advanced:"true"`
}

func (c *Consumer) validate() error {
	var errs []error
	errs = append(errs, c.CouchDB.validate(), c.NATS.validate(), c.Log.validate())
	if c.Concurrency < 1 || c.Concurrency > 10000 {
		errs = append(errs, fmt.Errorf("SPIEGEL_CONCURRENCY=%d: want 1 to 10000", c.Concurrency))
	}
	if c.PasswordsFile != "" {
		if _, err := os.Stat(c.PasswordsFile); err != nil {
			errs = append(errs, fmt.Errorf("SPIEGEL_PASSWORDS_FILE: %w", err))
		}
	}
	errs = append(errs, positive("SPIEGEL_SHUTDOWN_GRACE", c.ShutdownGrace),
		positive("SPIEGEL_RETRY_INITIAL", c.RetryInitial), positive("SPIEGEL_RETRY_MAX", c.RetryMax))
	if c.RetryMax < c.RetryInitial {
		errs = append(errs, fmt.Errorf("SPIEGEL_RETRY_MAX=%s: must not be below SPIEGEL_RETRY_INITIAL=%s", c.RetryMax, c.RetryInitial))
	}
	return errors.Join(errs...)
}

// Replicator is the configuration of the replicator binary.
type Replicator struct {
	Consumer
	HTTPAddr           string        `envconfig:"SPIEGEL_HTTP_ADDR" default:":8081" desc:"health and metrics listener (empty: off)" group:"Process"`
	ReplicationTimeout time.Duration `envconfig:"SPIEGEL_REPLICATION_TIMEOUT" default:"10m" desc:"longest one replication of one rule may run" group:"Replication"`
	Engine             string        `envconfig:"SPIEGEL_REPLICATION_ENGINE" default:"native" desc:"engine of rules that name none: native (the replicator runs the replication protocol) or couchdb (POST /_replicate)" group:"Replication"`
}

// Validate checks what envconfig cannot.
func (c *Replicator) Validate() error {
	errs := []error{c.Consumer.validate(), positive("SPIEGEL_REPLICATION_TIMEOUT", c.ReplicationTimeout)}
	if c.Engine != "couchdb" && c.Engine != "native" {
		errs = append(errs, fmt.Errorf("SPIEGEL_REPLICATION_ENGINE=%q: want couchdb or native", c.Engine))
	}
	return errors.Join(errs...)
}

// OnChange is the configuration of the onchange binary.
type OnChange struct {
	Consumer
	HTTPAddr           string        `envconfig:"SPIEGEL_HTTP_ADDR" default:":8082" desc:"health and metrics listener (empty: off)" group:"Process"`
	BatchSize          int           `envconfig:"SPIEGEL_CHANGES_BATCH" default:"100" desc:"changes read per _changes request" group:"Jobs" advanced:"true"`
	RequestConcurrency int           `envconfig:"SPIEGEL_REQUEST_CONCURRENCY" default:"10" desc:"requests in flight at once for one rule and db when block is false" group:"Webhooks and subjects" advanced:"true"`
	WebhookTimeout     time.Duration `envconfig:"SPIEGEL_WEBHOOK_TIMEOUT" default:"30s" desc:"timeout of one webhook request (a rule's timeout wins)" group:"Webhooks and subjects"`
	AllowedHosts       []string      `envconfig:"SPIEGEL_WEBHOOK_ALLOWED_HOSTS" desc:"comma-separated hosts (api.example, api.example:8443, *.example, 127.0.0.1) and CIDR ranges (10.0.0.0/8) webhooks may call; a named host at any address, any host whose address dialled is in a range. Empty: any host, but never at a loopback, private, link-local, CGNAT or other non-public address" group:"Webhooks and subjects"`
	SignatureSecrets   []string      `envconfig:"SPIEGEL_WEBHOOK_SIGNATURE_SECRET_NAMES" desc:"comma-separated names (not values) of secrets in the passwords file, new first, then the old one while rotating; when set, every request carries X-Spiegel-Signature: v1=<HMAC-SHA256 of timestamp, method, path?query, delivery id and body> per secret" group:"Webhooks and subjects"`
	// SignatureSecretsOld is SignatureSecrets' old name, read when the new one is unset.
	SignatureSecretsOld []string `envconfig:"SPIEGEL_WEBHOOK_SIGNATURE_SECRET" deprecated:"SPIEGEL_WEBHOOK_SIGNATURE_SECRET_NAMES" desc:"the old name of SPIEGEL_WEBHOOK_SIGNATURE_SECRET_NAMES, still read when that is unset" group:"Webhooks and subjects"`
	AllowedSubjects     []string `envconfig:"SPIEGEL_PUBLISH_ALLOWED_SUBJECTS" desc:"comma-separated subject filters (wildcards * and >) subject rules may publish to; empty: any subject but NATS' $ subjects, _INBOX.> and the service's own <prefix>.> other than <prefix>.changes.> (those are refused in any case)" group:"Webhooks and subjects"`
}

// Validate checks what envconfig cannot.
func (c *OnChange) Validate() error {
	errs := []error{c.Consumer.validate(), positive("SPIEGEL_WEBHOOK_TIMEOUT", c.WebhookTimeout)}
	if c.BatchSize < 1 || c.BatchSize > 10000 {
		errs = append(errs, fmt.Errorf("SPIEGEL_CHANGES_BATCH=%d: want 1 to 10000", c.BatchSize))
	}
	if c.RequestConcurrency < 1 || c.RequestConcurrency > 1000 {
		errs = append(errs, fmt.Errorf("SPIEGEL_REQUEST_CONCURRENCY=%d: want 1 to 1000", c.RequestConcurrency))
	}
	for _, h := range c.AllowedHosts {
		h = strings.TrimSpace(h)
		if strings.Contains(h, "/") {
			if _, err := netip.ParsePrefix(h); err != nil {
				errs = append(errs, fmt.Errorf("SPIEGEL_WEBHOOK_ALLOWED_HOSTS: %q is not a CIDR range (want e.g. 10.0.0.0/8 or fd00::/8)", h))
			}
		} else if strings.ContainsAny(h, " \t?#@") {
			errs = append(errs, fmt.Errorf("SPIEGEL_WEBHOOK_ALLOWED_HOSTS: %q is not a host, host:port, *.domain or CIDR range", h))
		}
	}
	for _, name := range c.SignatureSecrets {
		if strings.TrimSpace(name) == "" {
			errs = append(errs, errors.New("SPIEGEL_WEBHOOK_SIGNATURE_SECRET_NAMES: empty secret name in the list"))
		}
	}
	for _, f := range c.AllowedSubjects {
		if err := checkSubjectFilter(strings.TrimSpace(f)); err != nil {
			errs = append(errs, fmt.Errorf("SPIEGEL_PUBLISH_ALLOWED_SUBJECTS: %q: %w", f, err))
		}
	}
	return errors.Join(errs...)
}

// checkSubjectFilter checks the syntax of a NATS subject filter: non-empty tokens without
// whitespace, '*' and '>' only as whole tokens, '>' only last.
func checkSubjectFilter(f string) error {
	toks := strings.Split(f, ".")
	for i, t := range toks {
		switch {
		case t == "":
			return errors.New("empty token")
		case strings.ContainsAny(t, " \t\r\n\x00"):
			return errors.New("holds whitespace")
		case t == ">" && i != len(toks)-1:
			return errors.New("'>' must be the last token")
		case t != "*" && t != ">" && strings.ContainsAny(t, "*>"):
			return errors.New("wildcards must be whole tokens")
		}
	}
	return nil
}

// LogSettings returns the logging part (consumer.Spec).
func (c *Consumer) LogSettings() Log { return c.Log }

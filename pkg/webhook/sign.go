package webhook

import (
	"fmt"
	"net/http"
	"strconv"

	"github.com/spiegel-nats/spiegel/pkg/rules"
	"github.com/spiegel-nats/spiegel/pkg/webhook/signature"
)

// secrets returns the signature secrets' values, in the configured order.
func (c *Client) secrets() ([][]byte, error) {
	var out [][]byte
	for _, name := range c.cfg.SignatureSecrets {
		secret, ok := "", false
		if c.cfg.Passwords != nil {
			secret, ok = c.cfg.Passwords.Secret(name)
		}
		if !ok || secret == "" {
			return nil, fmt.Errorf("signature secret %q is not in the passwords file", name)
		}
		out = append(out, []byte(secret))
	}
	return out, nil
}

// signer returns the signer of one attempt of req, timestamped now.
func (c *Client) signer(req Request) (*signer, error) {
	secrets, err := c.secrets()
	if err != nil {
		return nil, err
	}
	s := &signer{v1: req.Signing != rules.SigningStandard, ts: c.now().Unix(), delivery: req.delivery(), body: req.Body,
		standard: req.Signing == rules.SigningStandard || req.Signing == rules.SigningBoth}
	if s.v1 {
		s.secrets = secrets
	}
	if s.standard {
		for i, secret := range secrets {
			key, err := signature.StandardKey(secret)
			if err != nil {
				return nil, fmt.Errorf("signature secret %q: %w", c.cfg.SignatureSecrets[i], err)
			}
			s.keys = append(s.keys, key)
		}
	}
	return s, nil
}

// signer sets the timestamp, delivery and signature headers of one attempt and its redirects, in
// the v1 scheme, the Standard Webhooks scheme or both.
type signer struct {
	v1, standard bool
	secrets      [][]byte // the v1 keys
	keys         [][]byte // the Standard Webhooks keys
	ts           int64
	delivery     string
	body         []byte
}

// sign sets the headers of r, whose body is body, signing (v1) r's method and request target.
func (s *signer) sign(r *http.Request, body []byte) {
	ts := strconv.FormatInt(s.ts, 10)
	r.Header.Del(SignatureHeader)
	r.Header.Del(StandardSignatureHeader)
	if s.v1 {
		r.Header.Set(TimestampHeader, ts)
		r.Header.Set(DeliveryHeader, s.delivery)
		if len(s.secrets) > 0 {
			r.Header.Set(SignatureHeader, signature.Sign(s.secrets, s.ts, r.Method, r.URL.RequestURI(), s.delivery, body))
		}
	}
	if s.standard {
		r.Header.Set(StandardTimestampHeader, ts)
		r.Header.Set(StandardIDHeader, s.delivery)
		if len(s.keys) > 0 {
			r.Header.Set(StandardSignatureHeader, signature.SignStandard(s.keys, s.delivery, s.ts, body))
		}
	}
}

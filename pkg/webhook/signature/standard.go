package signature

import (
	"encoding/base64"
	"errors"
	"strconv"
	"strings"
)

// The headers of the Standard Webhooks scheme (https://www.standardwebhooks.com/), which rules
// with "signing": "standard" or "both" send. Receivers verify them with any Standard Webhooks
// library; this package only signs.
//
//	webhook-id:        3f9c0b7e5d1a4c2b8e6f0a9d7c5b3e1f (the delivery id: the same for every retry)
//	webhook-timestamp: 1767225600                       (unix seconds, as X-Spiegel-Timestamp)
//	webhook-signature: v1,<base64>[ v1,<base64>...]     (one value per secret, space-separated)
//
// Each value is the standard base64 HMAC-SHA256, keyed with one secret's key (StandardKey), of
//
//	<webhook-id> "." <webhook-timestamp> "." <body>
//
// It does not cover the method or the request target, unlike the v1 scheme.
const (
	StandardIDHeader        = "webhook-id"
	StandardTimestampHeader = "webhook-timestamp"
	StandardSignatureHeader = "webhook-signature"
)

// StandardSecretPrefix marks a secret written as the Standard Webhooks spec gives them:
// "whsec_" followed by the base64 of the key.
const StandardSecretPrefix = "whsec_"

// ErrStandardSecret: a secret starts with StandardSecretPrefix but the rest is not standard
// base64 (or is empty).
var ErrStandardSecret = errors.New("signature: a whsec_ secret is not followed by standard base64")

// StandardKey returns the HMAC key of a secret for the Standard Webhooks scheme: for a secret
// written "whsec_<base64>", the decoded bytes, as the spec says; for a secret in any other form,
// its bytes as they are (the key the v1 scheme uses too). Its error, ErrStandardSecret, never
// quotes the secret.
func StandardKey(secret []byte) ([]byte, error) {
	rest, ok := strings.CutPrefix(string(secret), StandardSecretPrefix)
	if !ok {
		return secret, nil
	}
	key, err := base64.StdEncoding.DecodeString(rest)
	if err != nil || len(key) == 0 {
		return nil, ErrStandardSecret
	}
	return key, nil
}

// StandardMessage returns the signed content of the Standard Webhooks scheme.
func StandardMessage(id string, timestamp int64, body []byte) []byte {
	ts := strconv.FormatInt(timestamp, 10)
	b := make([]byte, 0, len(id)+len(ts)+len(body)+2)
	b = append(b, id...)
	b = append(b, '.')
	b = append(b, ts...)
	b = append(b, '.')
	return append(b, body...)
}

// SignStandard returns the webhook-signature value of a request: "v1,<base64>" for each key (see
// StandardKey), in order, joined by spaces. It returns "" when keys is empty.
func SignStandard(keys [][]byte, id string, timestamp int64, body []byte) string {
	msg := StandardMessage(id, timestamp, body)
	vals := make([]string, 0, len(keys))
	for _, k := range keys {
		vals = append(vals, Scheme+","+base64.StdEncoding.EncodeToString(mac(k, msg)))
	}
	return strings.Join(vals, " ")
}

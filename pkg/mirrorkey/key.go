// Package mirrorkey encodes the keys of a doc-state mirror (on_change rules with "mirror"): the
// NATS KV key of a doc is Encode(db, docID), "<b64(db)>.<b64(doc id)>", each part in unpadded
// base64url, so any db name and doc id (any bytes) give a valid KV key ([-/_=.a-zA-Z0-9]) and
// Decode gives them back. An empty part is written "=" (base64url never produces it). The
// package has no dependencies besides the standard library: a Go service that rebuilds its
// state from a mirror imports it to read keys.
package mirrorkey

import (
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
)

// enc is unpadded base64url, strict: every key has exactly one decoding and Encode(Decode(k))
// is k again.
var enc = base64.RawURLEncoding.Strict()

// empty stands for an empty db name or doc id.
const empty = "="

// ErrKey is the error of a key that is not Encode's output.
var ErrKey = errors.New("not a mirror key")

// Encode returns the mirror key of doc docID of db.
func Encode(db, docID string) string {
	return part(db) + "." + part(docID)
}

// DBPrefix returns the key filter of every doc of db, for a KV watch of one db
// (`nats kv watch BUCKET 'DBPrefix'`, kv.Watch(ctx, DBPrefix(db))).
func DBPrefix(db string) string { return part(db) + ".*" }

func part(s string) string {
	if s == "" {
		return empty
	}
	return enc.EncodeToString([]byte(s))
}

// Decode returns the db name and doc id of a mirror key.
func Decode(key string) (db, docID string, err error) {
	a, b, ok := strings.Cut(key, ".")
	if !ok {
		return "", "", fmt.Errorf("%w: %q has no '.'", ErrKey, key)
	}
	if db, err = unpart(a); err != nil {
		return "", "", fmt.Errorf("%w: %q: db part: %v", ErrKey, key, err)
	}
	if docID, err = unpart(b); err != nil {
		return "", "", fmt.Errorf("%w: %q: doc id part: %v", ErrKey, key, err)
	}
	return db, docID, nil
}

func unpart(s string) (string, error) {
	if s == empty {
		return "", nil
	}
	if s == "" {
		return "", errors.New("empty")
	}
	for i := 0; i < len(s); i++ { // the decoder would skip '\r' and '\n'
		c := s[i]
		if !(c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return "", fmt.Errorf("byte %q is not base64url", c)
		}
	}
	b, err := enc.DecodeString(s)
	if err != nil {
		return "", err
	}
	return string(b), nil
}

// FencePrefix starts the keys a mirror keeps for itself, one per db: "_spiegel.fence.<b64(db)>".
// They are not doc keys (Decode refuses them, DBPrefix does not match them): a reader skips them.
const FencePrefix = "_spiegel.fence."

// Fence returns the key of db's fence in a mirror bucket: each job that writes db's keys first
// writes it, and every write of the job expects it unchanged, so a job that lost its turn to a
// later one writes nothing more.
func Fence(db string) string { return FencePrefix + part(db) }

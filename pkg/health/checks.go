package health

import (
	"context"
	"errors"
)

// ErrNATSDown is the readiness of a check that needs NATS while the connection is down.
var ErrNATSDown = errors.New("not checked: NATS not connected")

// connection is the part of *nats.Conn the checks need.
type connection interface {
	IsConnected() bool
}

// Dependencies returns the readiness checks every process shares: "couchdb" (the spiegel db
// answers, read with dbInfo), "nats" (the connection is up) and, under jsName, a JetStream
// check (stream or consumers present) that answers ErrNATSDown at once while the connection is
// down: a JetStream request would otherwise wait for a reconnect until the probe times out.
func Dependencies(dbInfo func(ctx context.Context) error, nc connection, jsName string, js Check) map[string]Check {
	return map[string]Check{
		"couchdb": dbInfo,
		"nats": func(context.Context) error {
			if !nc.IsConnected() {
				return errors.New("not connected")
			}
			return nil
		},
		jsName: func(ctx context.Context) error {
			if !nc.IsConnected() {
				return ErrNATSDown
			}
			return js(ctx)
		},
	}
}

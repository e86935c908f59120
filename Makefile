# Spiegel for NATS. `make run` runs the pipeline with a demo; `make test` runs the whole suite;
# `make chaos SEED=42 DURATION=30m` runs the long chaos suite.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -s -w -X github.com/spiegel-nats/spiegel/pkg/config.Version=$(VERSION)
BIN := bin

.PHONY: all build run test bench bench-e2e bench-scale bench-streams fuzz vet clean chaos

all: build

build:
	@mkdir -p $(BIN)
	CGO_ENABLED=0 go build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ ./producer $(patsubst %/main.go,./%,$(wildcard consumers/*/main.go))
	go build -o $(BIN)/nats-server github.com/nats-io/nats-server/v2

run: build
	@scripts/run.sh

test:
	@scripts/test.sh

bench:
	@scripts/bench.sh

bench-e2e:
	@scripts/bench-e2e.sh

# The scale simulation (BenchmarkScale, no CouchDB) at SCALE_DBS (default 10000,30000,100000):
# bench-scale/scale.md with its charts.
bench-scale:
	@scripts/bench-scale.sh

# Change streams against a hand-written loop (BenchmarkStreams in scripts/e2e): per workload of
# BENCH_STREAMS_WORKLOADS (default 1x100000,1x20000,100x500: dbs x docs) and NATS topology of
# BENCH_STREAMS_TOPOLOGIES (r1,r3), a _changes → PublishMsgAsync loop, a subject rule and a
# mirror rule through the real binaries: bench-streams/report.md.
bench-streams:
	@scripts/bench-streams.sh

# The long chaos run (scripts/chaos): SEED (default: drawn and printed) and DURATION of writes
# and faults. It runs against its own PouchDB Server on disk, or the CouchDB at COUCHDB_URL or
# CHAOS_COUCHDB_URL, which it never restarts (its restart fault cuts the connections at a proxy;
# CHAOS_COUCHDB_RESTART_CMD restarts the server instead). Output: .chaos/.
SEED ?=
DURATION ?= 30m
chaos: build
	CHAOS_LONG=1 CHAOS_SEED=$(SEED) CHAOS_DURATION=$(DURATION) CHAOS_COUCHDB_URL=$${CHAOS_COUCHDB_URL:-$${COUCHDB_URL:-}} \
	  go test -count=1 -v -timeout 24h -run '^TestChaosLong$$' ./scripts/chaos

FUZZTIME ?= 20s
fuzz:
	@for t in $$(go test -list 'Fuzz.*' ./... | grep -E '^Fuzz'); do \
	  pkg=$$(grep -rl "func $$t(" --include='*_test.go' . | head -1 | xargs dirname); \
	  echo "== $$pkg $$t"; go test -run x -fuzz "^$$t$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; \
	done

vet:
	go vet ./...
	cd deployments && go vet ./...
	cd scripts/benchreport && go vet ./...

clean:
	rm -rf $(BIN) .run .chaos bench-scale bench-e2e bench-streams

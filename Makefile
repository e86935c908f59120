# Spiegel for NATS. `make run` runs the pipeline with a demo; `make test` runs the whole suite.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -s -w -X github.com/spiegel-nats/spiegel/pkg/config.Version=$(VERSION)
BIN := bin

.PHONY: all build run test bench bench-e2e fuzz vet clean

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

FUZZTIME ?= 20s
fuzz:
	@for t in $$(go test -list 'Fuzz.*' ./... | grep -E '^Fuzz'); do \
	  pkg=$$(grep -rl "func $$t(" --include='*_test.go' . | head -1 | xargs dirname); \
	  echo "== $$pkg $$t"; go test -run x -fuzz "^$$t$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; \
	done

vet:
	go vet ./...
	cd deployments && go vet ./...

clean:
	rm -rf $(BIN) .run

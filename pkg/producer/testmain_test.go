package producer

import (
	"os"
	"testing"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// TestMain reports the tests skipped for want of a CouchDB in one line (couchtest.Main).
func TestMain(m *testing.M) { os.Exit(couchtest.Main(m)) }

package couchtest

import (
	"os"
	"testing"
)

// TestMain reports the tests skipped for want of a CouchDB in one line (Main).
func TestMain(m *testing.M) { os.Exit(Main(m)) }

package logging

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRedactURL(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		"http://admin:s3cret@couch:5984/db":  "http://admin:xxxxx@couch:5984/db",
		"http://admin@couch:5984/db":         "http://admin@couch:5984/db",
		"http://couch:5984/db":               "http://couch:5984/db",
		"not a url http://u:p%zz@h/ x":       "not a url http://u:xxxxx@h/ x",
		"Get \"https://a:b@h:1/x\": refused": "Get \"https://a:xxxxx@h:1/x\": refused",
	}
	for in, want := range cases {
		got := RedactURL(in)
		assert.Equal(t, want, got, in)
		assert.NotContains(t, got, "s3cret")
	}
}

func TestNewRejectsBadValues(t *testing.T) {
	t.Parallel()
	_, err := New("loud", "json", &bytes.Buffer{})
	assert.ErrorContains(t, err, "loud")
	_, err = New("info", "xml", &bytes.Buffer{})
	assert.ErrorContains(t, err, "xml")
	var buf bytes.Buffer
	l, err := New("info", "json", &buf)
	require.NoError(t, err)
	l.WithField("component", "x").Info("hello")
	assert.Contains(t, buf.String(), `"component":"x"`)
}

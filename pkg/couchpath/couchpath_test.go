package couchpath

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSegment(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"user_42":          "user_42",
		"a/b+c$d(e)-f_g":   "a%2Fb%2Bc$d%28e%29-f_g",
		"with space":       "with%20space",
		"_design/x":        "_design%2Fx",
		"pct%41":           "pct%2541",
		"plus+plus++":      "plus%2Bplus%2B%2B",
		"unicode-é":        "unicode-%C3%A9",
		"":                 "",
		"question?hash#eq": "question%3Fhash%23eq",
	} {
		assert.Equal(t, want, Segment(in), in)
	}
}

// TestPlusSafe: the server receives %2B wherever the client's path had '+', whether the path was
// built from Path alone or with a RawPath (as kivik does), and the caller's request is unchanged.
func TestPlusSafe(t *testing.T) {
	t.Parallel()
	var got []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = append(got, r.RequestURI)
	}))
	t.Cleanup(srv.Close)
	hc := &http.Client{Transport: PlusSafe(nil)}

	req, err := http.NewRequest(http.MethodGet, srv.URL+"/a+b/doc%2Fid?q=x+y", nil)
	require.NoError(t, err)
	resp, err := hc.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, "/a+b/doc%2Fid", req.URL.EscapedPath(), "the caller's request is not changed")

	req, err = http.NewRequest(http.MethodGet, srv.URL+"/plain", nil)
	require.NoError(t, err)
	resp, err = hc.Do(req)
	require.NoError(t, err)
	resp.Body.Close()

	assert.Equal(t, []string{"/a%2Bb/doc%2Fid?q=x+y", "/plain"}, got, "only the path's '+' is escaped")
}

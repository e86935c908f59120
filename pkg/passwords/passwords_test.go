package passwords

import (
	"errors"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const fileContent = `{
  "couch.example": {"admin": "pw-host", "other": "pw-other"},
  "couch.example:6984": {"admin": "pw-hostport"},
  "API.Example": {"hook": "p@ss:w/rd?#"},
  "[::1]:5984": {"admin": "pw-v6"},
  "_secrets": {"hmac": "secret-hmac", "empty": ""}
}`

func writeFile(t *testing.T, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "passwords.json")
	require.NoError(t, os.WriteFile(path, []byte(content), 0o600))
	return path
}

func TestInject(t *testing.T) {
	t.Parallel()
	f, err := Load(writeFile(t, fileContent))
	require.NoError(t, err)
	tests := []struct {
		in, want string
	}{
		{"http://admin@couch.example:5984/db1", "http://admin:pw-host@couch.example:5984/db1"},
		{"https://admin@couch.example:6984/db1", "https://admin:pw-hostport@couch.example:6984/db1"},
		{"https://other@couch.example:6984/db1", "https://other:pw-other@couch.example:6984/db1"},
		{"http://admin@COUCH.example/a%2Fb%2Bc", "http://admin:pw-host@COUCH.example/a%2Fb%2Bc"},
		{"https://hook@api.example/x?y=1", "https://hook:p%40ss%3Aw%2Frd%3F%23@api.example/x?y=1"},
		{"http://admin@[::1]:5984/db", "http://admin:pw-v6@[::1]:5984/db"},
		{"http://nobody@couch.example/db", "http://nobody@couch.example/db"},
		{"http://admin@unknown.example/db", "http://admin@unknown.example/db"},
		{"http://couch.example/db", "http://couch.example/db"},
		{"http://admin:given@couch.example/db", "http://admin:given@couch.example/db"},
		{"db_name", "db_name"},
	}
	for _, tt := range tests {
		got, err := f.Inject(tt.in)
		require.NoError(t, err, tt.in)
		assert.Equal(t, tt.want, got, tt.in)
	}

	_, err = f.Inject("http://admin@couch.example:port/db")
	require.ErrorIs(t, err, ErrBadURL)
	assert.NotContains(t, err.Error(), "couch.example")
}

func TestLookupAndSecrets(t *testing.T) {
	t.Parallel()
	f, err := Load(writeFile(t, fileContent))
	require.NoError(t, err)
	pw, ok := f.Lookup("couch.example", "", "admin")
	assert.True(t, ok)
	assert.Equal(t, "pw-host", pw)
	pw, ok = f.Lookup("couch.example", "6984", "admin")
	assert.True(t, ok)
	assert.Equal(t, "pw-hostport", pw)
	pw, ok = f.Lookup("couch.example", "6984", "other")
	assert.True(t, ok, "falls back to the hostname key")
	assert.Equal(t, "pw-other", pw)
	_, ok = f.Lookup("couch.example", "", "Admin")
	assert.False(t, ok, "user names are case-sensitive")

	s, ok := f.Secret("hmac")
	assert.True(t, ok)
	assert.Equal(t, "secret-hmac", s)
	_, ok = f.Secret("nope")
	assert.False(t, ok)
	assert.Equal(t, []string{"p@ss:w/rd?#", "pw-host", "pw-hostport", "pw-other", "pw-v6", "secret-hmac"}, f.Secrets())
	for _, secret := range f.Secrets() {
		assert.NotContains(t, f.String(), secret)
	}
}

func TestEmptyPath(t *testing.T) {
	t.Parallel()
	f, err := Load("")
	require.NoError(t, err)
	require.NoError(t, f.Reload())
	got, err := f.Inject("http://admin@couch.example/db")
	require.NoError(t, err)
	assert.Equal(t, "http://admin@couch.example/db", got)
	assert.Empty(t, f.Secrets())
}

func TestLoadErrors(t *testing.T) {
	t.Parallel()
	const secret = "top-secret-value"
	tests := []struct {
		name, content, want string
	}{
		{"syntax", `{"h": {"u": "` + secret + `"`, "invalid JSON"},
		{"syntax inside value", `{"h": {"u": "` + secret + `" x}}`, "invalid JSON at byte offset"},
		{"not object", `["` + secret + `"]`, "want a JSON object"},
		{"host not object", `{"h": "` + secret + `"}`, `"h": want an object`},
		{"password not string", `{"h": {"u": 5}}`, `"h": "u": the value must be a string`},
		{"secret not string", `{"_secrets": {"k": [1]}}`, `"_secrets": "k"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			path := writeFile(t, tt.content)
			_, err := Load(path)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tt.want)
			assert.Contains(t, err.Error(), path)
			assert.NotContains(t, err.Error(), secret)
		})
	}
	_, err := Load(filepath.Join(t.TempDir(), "missing.json"))
	require.Error(t, err)
	assert.True(t, errors.Is(err, os.ErrNotExist))
	assert.Contains(t, err.Error(), "missing.json")
}

func TestReload(t *testing.T) {
	t.Parallel()
	path := writeFile(t, `{"h": {"u": "one"}}`)
	f, err := Load(path)
	require.NoError(t, err)

	require.NoError(t, os.WriteFile(path, []byte(`{"h": {"u": "two"}}`), 0o600))
	require.NoError(t, f.Reload())
	pw, _ := f.Lookup("h", "", "u")
	assert.Equal(t, "two", pw)

	// A broken file keeps the old content.
	require.NoError(t, os.WriteFile(path, []byte(`{"h": `), 0o600))
	require.Error(t, f.Reload())
	pw, _ = f.Lookup("h", "", "u")
	assert.Equal(t, "two", pw)

	require.NoError(t, os.Remove(path))
	require.Error(t, f.Reload())
	pw, _ = f.Lookup("h", "", "u")
	assert.Equal(t, "two", pw)
}

func TestConcurrentReload(t *testing.T) {
	t.Parallel()
	path := writeFile(t, `{"h": {"u": "pw"}}`)
	f, err := Load(path)
	require.NoError(t, err)
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				got, err := f.Inject("http://u@h/db")
				if err != nil || !strings.HasPrefix(got, "http://u:pw@h") {
					t.Errorf("inject: %q %v", got, err)
					return
				}
				_ = f.Secrets()
			}
		}()
	}
	for i := 0; i < 50; i++ {
		require.NoError(t, f.Reload())
	}
	wg.Wait()
}

// FuzzInject: any string never panics; an error never quotes the input; the injected URL parses
// back to the same user and password.
func FuzzInject(f *testing.F) {
	f.Add("http://admin@couch.example:6984/db")
	f.Add("http://admin@[::1]:5984/db")
	f.Add("http://%zz@h/")
	f.Fuzz(func(t *testing.T, raw string) {
		file := &File{hosts: map[string]map[string]string{}, secrets: map[string]string{}}
		if u, err := url.Parse(raw); err == nil && u.User != nil {
			file.hosts[strings.ToLower(u.Hostname())] = map[string]string{u.User.Username(): "pw:@/x"}
		}
		got, err := file.Inject(raw)
		if err != nil {
			if raw != "" && strings.Contains(err.Error(), raw) {
				t.Fatalf("error quotes the URL: %v", err)
			}
			return
		}
		if got == raw {
			return
		}
		u, err := url.Parse(got)
		if err != nil {
			t.Fatalf("injected URL %q does not parse: %v", got, err)
		}
		if pw, _ := u.User.Password(); pw != "pw:@/x" {
			t.Fatalf("password %q in %q", pw, got)
		}
	})
}

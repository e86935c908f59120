package natsjs

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/natstest"
)

// connectCase is one client configuration tried against a secured server.
type connectCase struct {
	name    string
	opts    Options  // URLs, when empty, is the server's
	wantErr []string // empty: Connect succeeds and JetStream works; else regexps the error matches
	secrets []string // must appear neither in the error nor in the logs
}

// runConnectCases tries every case against srv. A failing Connect must give up by itself: its
// context has a deadline, and the deadline must not be what ended it (an auth or TLS failure that
// is retried until ctx ends would hang a starting service instead of reporting the reason).
func runConnectCases(t *testing.T, srv *natstest.Server, cases []connectCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			log, hook := logtest.NewNullLogger()
			log.SetLevel(logrus.DebugLevel)
			o := tc.opts
			if o.URLs == "" {
				o.URLs = srv.URL()
			}
			o.ConnectTimeout = 2 * time.Second
			ctx, cancel := context.WithTimeout(t.Context(), 8*time.Second)
			defer cancel()

			nc, err := Connect(ctx, o, log)
			require.NoError(t, ctx.Err(), "Connect returned only because its context ended")
			for _, e := range hook.AllEntries() {
				line, _ := e.String()
				for _, s := range tc.secrets {
					assert.NotContains(t, line, s, "secret logged")
				}
			}
			if len(tc.wantErr) == 0 {
				require.NoError(t, err)
				t.Cleanup(nc.Close)
				useJetStream(t, nc)
				return
			}
			require.Error(t, err)
			assert.Nil(t, nc)
			for _, want := range tc.wantErr {
				assert.Regexp(t, "(?i)"+want, err.Error())
			}
			for _, s := range tc.secrets {
				assert.NotContains(t, err.Error(), s, "secret in error")
			}
		})
	}
}

// useJetStream proves the connection is authorised for JetStream: it installs the topology and
// checks that it is there.
func useJetStream(t *testing.T, nc *nats.Conn) {
	t.Helper()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	topo := DefaultTopology("")
	require.NoError(t, Ensure(t.Context(), js, topo))
	require.NoError(t, CheckInstalled(t.Context(), js, topo))
}

func TestConnectUserPassword(t *testing.T) {
	t.Parallel()
	const password = "pa55-w0rd-secret"
	srv := natstest.Start(t, func(o *server.Options) {
		o.Username = "spiegel"
		o.Password = password
	})
	runConnectCases(t, srv, []connectCase{
		{name: "right credentials", opts: Options{User: "spiegel", Password: password}},
		{
			name:    "wrong password",
			opts:    Options{User: "spiegel", Password: "wrong-" + password},
			wantErr: []string{"Authorization Violation"},
			secrets: []string{password},
		},
		{
			name:    "no credentials",
			wantErr: []string{"Authorization Violation"},
		},
	})
}

func TestConnectToken(t *testing.T) {
	t.Parallel()
	const token = "t0ken-secret-value"
	srv := natstest.Start(t, func(o *server.Options) { o.Authorization = token })
	runConnectCases(t, srv, []connectCase{
		{name: "right token", opts: Options{Token: token}},
		{
			name:    "wrong token",
			opts:    Options{Token: "wrong-" + token},
			wantErr: []string{"Authorization Violation"},
			secrets: []string{token},
		},
	})
}

func TestConnectNKeySeedFile(t *testing.T) {
	t.Parallel()
	user, err := nkeys.CreateUser()
	require.NoError(t, err)
	pub, err := user.PublicKey()
	require.NoError(t, err)
	seed, err := user.Seed()
	require.NoError(t, err)
	stranger, err := nkeys.CreateUser()
	require.NoError(t, err)
	strangerSeed, err := stranger.Seed()
	require.NoError(t, err)

	dir := t.TempDir()
	seedFile := writeSecret(t, dir, "user.nk", seed)
	strangerFile := writeSecret(t, dir, "stranger.nk", strangerSeed)
	garbageFile := writeSecret(t, dir, "garbage.nk", []byte("not a seed\n"))
	missingFile := filepath.Join(dir, "missing.nk")

	srv := natstest.Start(t, func(o *server.Options) { o.Nkeys = []*server.NkeyUser{{Nkey: pub}} })
	runConnectCases(t, srv, []connectCase{
		{name: "configured nkey", opts: Options{NKeySeedFile: seedFile}},
		{
			name:    "unknown nkey",
			opts:    Options{NKeySeedFile: strangerFile},
			wantErr: []string{"Authorization Violation"},
			secrets: []string{string(strangerSeed)},
		},
		{
			name:    "missing seed file",
			opts:    Options{NKeySeedFile: missingFile},
			wantErr: []string{"nkey seed file " + regexp.QuoteMeta(missingFile), "no such file"},
		},
		{
			name:    "file without a seed",
			opts:    Options{NKeySeedFile: garbageFile},
			wantErr: []string{"nkey seed file " + regexp.QuoteMeta(garbageFile), "no nkey seed found"},
		},
	})
}

func TestConnectCredsFile(t *testing.T) {
	t.Parallel()
	operator, err := nkeys.CreateOperator()
	require.NoError(t, err)
	operatorPub, err := operator.PublicKey()
	require.NoError(t, err)
	_, systemPub, systemJWT := newAccount(t, operator, "SYS", false)
	accountKey, accountPub, accountJWT := newAccount(t, operator, "SPIEGEL", true)

	oc := jwt.NewOperatorClaims(operatorPub)
	oc.Name = "TEST"
	oc.SystemAccount = systemPub
	operatorJWT, err := oc.Encode(operator)
	require.NoError(t, err)
	trusted, err := jwt.DecodeOperatorClaims(operatorJWT)
	require.NoError(t, err)
	resolver := &server.MemAccResolver{}
	require.NoError(t, resolver.Store(systemPub, systemJWT))
	require.NoError(t, resolver.Store(accountPub, accountJWT))

	dir := t.TempDir()
	creds := writeSecret(t, dir, "spiegel.creds", newUserCreds(t, accountKey))
	strangerKey, err := nkeys.CreateAccount() // an account the operator never signed
	require.NoError(t, err)
	strangerCreds := newUserCreds(t, strangerKey)
	strangerFile := writeSecret(t, dir, "stranger.creds", strangerCreds)
	missingFile := filepath.Join(dir, "missing.creds")
	garbageFile := writeSecret(t, dir, "garbage.creds", []byte("not creds\n"))

	srv := natstest.Start(t, func(o *server.Options) {
		o.TrustedOperators = []*jwt.OperatorClaims{trusted}
		o.AccountResolver = resolver
		o.SystemAccount = systemPub
	})
	runConnectCases(t, srv, []connectCase{
		{name: "user of a JetStream account", opts: Options{CredsFile: creds}},
		{
			name:    "user of an unknown account",
			opts:    Options{CredsFile: strangerFile},
			wantErr: []string{"Authorization Violation"},
			secrets: []string{seedOf(t, strangerCreds)},
		},
		{
			name:    "missing creds file",
			opts:    Options{CredsFile: missingFile},
			wantErr: []string{"creds file " + regexp.QuoteMeta(missingFile), "no such file"},
		},
		{
			name:    "file without credentials",
			opts:    Options{CredsFile: garbageFile},
			wantErr: []string{"creds file " + regexp.QuoteMeta(garbageFile), "no nkey seed found"},
		},
	})
}

func TestConnectTLS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	pki := newPKI(t, dir)
	garbageCA := writeSecret(t, dir, "garbage-ca.pem", []byte("not a certificate\n"))
	plain := natstest.Start(t)
	srv := natstest.Start(t, func(o *server.Options) {
		tc, err := server.GenTLSConfig(&server.TLSConfigOpts{
			CertFile: pki.serverCert, KeyFile: pki.serverKey, CaFile: pki.caFile, Verify: true,
		})
		require.NoError(t, err)
		o.TLSConfig = tc
		o.TLSVerify = true
		o.TLSTimeout = 2
	})
	runConnectCases(t, srv, []connectCase{
		{
			name: "CA and client certificate",
			opts: Options{CAFile: pki.caFile, CertFile: pki.clientCert, KeyFile: pki.clientKey},
		},
		{
			name:    "server certificate not trusted",
			opts:    Options{CertFile: pki.clientCert, KeyFile: pki.clientKey},
			wantErr: []string{"certificate signed by unknown authority"},
		},
		{
			name: "no client certificate",
			opts: Options{CAFile: pki.caFile},
			// TLS 1.3 lets the client finish its handshake before the server checks the client
			// certificate: the rejection arrives either as the server's alert or as the
			// connection closing right after the handshake, depending on timing.
			wantErr: []string{"tls: certificate required|connection closed by remote after TLS handshake"},
		},
		{
			name:    "client certificate without key",
			opts:    Options{CAFile: pki.caFile, CertFile: pki.clientCert},
			wantErr: []string{"both the cert and the key file"},
		},
		{
			name:    "missing CA file",
			opts:    Options{CAFile: filepath.Join(dir, "missing-ca.pem"), CertFile: pki.clientCert, KeyFile: pki.clientKey},
			wantErr: []string{"CA file " + regexp.QuoteMeta(filepath.Join(dir, "missing-ca.pem")), "no such file"},
		},
		{
			name:    "CA file without certificates",
			opts:    Options{CAFile: garbageCA, CertFile: pki.clientCert, KeyFile: pki.clientKey},
			wantErr: []string{"CA file " + regexp.QuoteMeta(garbageCA), "failed to parse root certificate"},
		},
		{
			name:    "missing client certificate file",
			opts:    Options{CAFile: pki.caFile, CertFile: filepath.Join(dir, "missing.pem"), KeyFile: pki.clientKey},
			wantErr: []string{"client certificate " + regexp.QuoteMeta(filepath.Join(dir, "missing.pem")), "no such file"},
		},
		{
			name:    "server without TLS",
			opts:    Options{URLs: plain.URL(), CAFile: pki.caFile, CertFile: pki.clientCert, KeyFile: pki.clientKey},
			wantErr: []string{"secure connection not available"},
		},
	})
}

// newAccount returns the key pair, public key and JWT of an account signed by operator, with
// unlimited JetStream when js is set.
func newAccount(t *testing.T, operator nkeys.KeyPair, name string, js bool) (nkeys.KeyPair, string, string) {
	t.Helper()
	kp, err := nkeys.CreateAccount()
	require.NoError(t, err)
	pub, err := kp.PublicKey()
	require.NoError(t, err)
	ac := jwt.NewAccountClaims(pub)
	ac.Name = name
	if js {
		ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
	}
	token, err := ac.Encode(operator)
	require.NoError(t, err)
	return kp, pub, token
}

// newUserCreds returns the content of a .creds file for a new user of account.
func newUserCreds(t *testing.T, account nkeys.KeyPair) []byte {
	t.Helper()
	user, err := nkeys.CreateUser()
	require.NoError(t, err)
	pub, err := user.PublicKey()
	require.NoError(t, err)
	uc := jwt.NewUserClaims(pub)
	uc.Name = "spiegel"
	token, err := uc.Encode(account)
	require.NoError(t, err)
	seed, err := user.Seed()
	require.NoError(t, err)
	creds, err := jwt.FormatUserConfig(token, seed)
	require.NoError(t, err)
	return creds
}

func seedOf(t *testing.T, creds []byte) string {
	t.Helper()
	kp, err := jwt.ParseDecoratedUserNKey(creds)
	require.NoError(t, err)
	seed, err := kp.Seed()
	require.NoError(t, err)
	return string(seed)
}

func writeSecret(t *testing.T, dir, name string, content []byte) string {
	t.Helper()
	path := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(path, content, 0o600))
	return path
}

type pkiFiles struct {
	caFile, serverCert, serverKey, clientCert, clientKey string
}

// newPKI writes a CA, a server certificate for 127.0.0.1 and a client certificate, all signed by
// the CA, as PEM files in dir.
func newPKI(t *testing.T, dir string) pkiFiles {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "spiegel test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	ca, err := x509.ParseCertificate(caDER)
	require.NoError(t, err)

	leaf := func(serial int64, cn string, usage x509.ExtKeyUsage, ips []net.IP) (string, string) {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial),
			Subject:      pkix.Name{CommonName: cn},
			NotBefore:    time.Now().Add(-time.Hour),
			NotAfter:     time.Now().Add(time.Hour),
			KeyUsage:     x509.KeyUsageDigitalSignature,
			ExtKeyUsage:  []x509.ExtKeyUsage{usage},
			IPAddresses:  ips,
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		require.NoError(t, err)
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		require.NoError(t, err)
		certFile := writeSecret(t, dir, cn+".pem", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
		keyFile := writeSecret(t, dir, cn+"-key.pem", pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}))
		return certFile, keyFile
	}
	p := pkiFiles{caFile: writeSecret(t, dir, "ca.pem", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}))}
	p.serverCert, p.serverKey = leaf(2, "server", x509.ExtKeyUsageServerAuth, []net.IP{net.IPv4(127, 0, 0, 1)})
	p.clientCert, p.clientKey = leaf(3, "client", x509.ExtKeyUsageClientAuth, nil)
	return p
}

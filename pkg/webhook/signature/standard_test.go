package signature_test

import (
	"encoding/base64"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/webhook/signature"
)

// The test vector of the Standard Webhooks reference libraries (the Go library's TestWebhookSign
// and the other languages' sign tests).
const (
	vectorSecret    = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	vectorID        = "msg_p5jXN8AQM9LWM0D4loKWxJek"
	vectorTimestamp = 1614265330
	vectorBody      = `{"test": 2432232314}`
	vectorSignature = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
)

func TestSignStandardVector(t *testing.T) {
	t.Parallel()
	key, err := signature.StandardKey([]byte(vectorSecret))
	require.NoError(t, err)
	want, _ := base64.StdEncoding.DecodeString("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
	assert.Equal(t, want, key, "the key is the base64-decoded part of a whsec_ secret")
	assert.Equal(t, vectorSignature, signature.SignStandard([][]byte{key}, vectorID, vectorTimestamp, []byte(vectorBody)))
	assert.Equal(t, vectorID+"."+strconv.Itoa(vectorTimestamp)+"."+vectorBody,
		string(signature.StandardMessage(vectorID, vectorTimestamp, []byte(vectorBody))))
	assert.Empty(t, signature.SignStandard(nil, vectorID, vectorTimestamp, []byte(vectorBody)))
}

// The official Go library of Standard Webhooks verifies what SignStandard makes, with every
// secret of a rotation, and refuses another secret, another body or another id.
func TestSignStandardVerifiesWithTheReferenceLibrary(t *testing.T) {
	t.Parallel()
	secrets := []string{"whsec_" + base64.StdEncoding.EncodeToString([]byte("new key, 24 bytes long!!")), "a raw old secret"}
	var keys [][]byte
	for _, s := range secrets {
		k, err := signature.StandardKey([]byte(s))
		require.NoError(t, err)
		keys = append(keys, k)
	}
	assert.Equal(t, []byte("a raw old secret"), keys[1], "a secret in another form is used as its bytes")
	ts := time.Now().Unix()
	body := []byte(`{"id":"doc1"}`)
	sig := signature.SignStandard(keys, "delivery-1", ts, body)
	require.Len(t, strings.Split(sig, " "), 2, "one value per secret, space-separated")
	h := http.Header{}
	h.Set(signature.StandardIDHeader, "delivery-1")
	h.Set(signature.StandardTimestampHeader, strconv.FormatInt(ts, 10))
	h.Set(signature.StandardSignatureHeader, sig)

	byWhsec, err := standardwebhooks.NewWebhook(secrets[0])
	require.NoError(t, err)
	byRaw, err := standardwebhooks.NewWebhookRaw([]byte(secrets[1]))
	require.NoError(t, err)
	other, err := standardwebhooks.NewWebhookRaw([]byte("another secret"))
	require.NoError(t, err)
	assert.NoError(t, byWhsec.Verify(body, h), "the new secret")
	assert.NoError(t, byRaw.Verify(body, h), "the old secret")
	assert.ErrorIs(t, other.Verify(body, h), standardwebhooks.ErrNoMatchingSignature)
	assert.ErrorIs(t, byWhsec.Verify([]byte(`{"id":"doc2"}`), h), standardwebhooks.ErrNoMatchingSignature)
	h.Set(signature.StandardIDHeader, "delivery-2")
	assert.ErrorIs(t, byWhsec.Verify(body, h), standardwebhooks.ErrNoMatchingSignature)
}

func TestStandardKey(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{"whsec_", "whsec_not base64!", "whsec_YWJj*"} {
		_, err := signature.StandardKey([]byte(bad))
		require.ErrorIs(t, err, signature.ErrStandardSecret, bad)
		assert.Equal(t, signature.ErrStandardSecret.Error(), err.Error(), "the error never quotes the secret")
	}
	for secret, want := range map[string]string{
		"whsec_YWJj": "abc",
		"plain":      "plain",
		"WHSEC_YWJj": "WHSEC_YWJj", // the prefix is case-sensitive, as in the reference libraries
		"YWJj":       "YWJj",
	} {
		k, err := signature.StandardKey([]byte(secret))
		require.NoError(t, err, secret)
		assert.Equal(t, want, string(k), secret)
	}
}

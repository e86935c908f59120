package signature_test

import (
	"fmt"
	"log"
	"net/http"

	"github.com/spiegel-nats/spiegel/pkg/webhook/signature"
)

// A receiver that only sees requests signed by its Spiegel installation: during a rotation it
// lists the new and the old secret.
func ExampleVerifier_Handler() {
	v := signature.Verifier{Secrets: [][]byte{[]byte("new-secret"), []byte("old-secret")}}
	hook := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The request comes from Spiegel, for this method, path and query, and its timestamp is
		// within 5 minutes of this clock. Acting twice on a retry is avoided by remembering
		// r.Header.Get(signature.DeliveryHeader).
		fmt.Fprintln(w, "ok")
	})
	http.Handle("/hook/", v.Handler(1<<20, hook))
	if false {
		log.Fatal(http.ListenAndServe(":8000", nil))
	}
	fmt.Println("listening")
	// Output: listening
}

// Verifying by hand, with the raw body already read.
func ExampleVerify() {
	r, _ := http.NewRequest("POST", "http://receiver/hook?x=1", nil)
	err := signature.Verify(r, nil, []byte("secret"))
	fmt.Println(err)
	// Output: signature: missing or malformed X-Spiegel-Timestamp, X-Spiegel-Delivery or X-Spiegel-Signature
}

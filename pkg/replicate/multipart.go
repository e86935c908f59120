package replicate

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"net/url"

	"github.com/spiegel-nats/spiegel/pkg/couch"
	"github.com/spiegel-nats/spiegel/pkg/couchpath"
)

// putMultipart streams one revision to the target: PUT /db/id?new_edits=false as
// multipart/related, a JSON part whose _attachments mark names as "follows", then one part per
// name in that order, each copied from GET /db/id/name?rev= on the source, so that no
// attachment is held in memory. It is tried up to maxAttempts times on connection failures and
// 5xx. ok is false when the revision must travel inline instead (the target refuses multipart,
// a stub it was sent is missing, or the source no longer has the revision); a refusal of the
// doc (403, 409, 413, ...) is a failure.
func (r *run) putMultipart(ctx context.Context, d attachedDoc, names []string) (failure *writeFailure, ok bool, err error) {
	var fields map[string]json.RawMessage
	var atts map[string]json.RawMessage
	if err := json.Unmarshal(d.doc.Body, &fields); err != nil {
		return nil, false, nil
	}
	if err := json.Unmarshal(fields["_attachments"], &atts); err != nil {
		return nil, false, nil
	}
	for _, n := range names {
		s := d.atts[n]
		atts[n], _ = json.Marshal(map[string]any{
			"content_type": s.ContentType, "length": s.Length, "revpos": s.RevPos, "follows": true,
		})
	}
	fields["_attachments"], _ = json.Marshal(atts)
	jsonPart, err := json.Marshal(fields)
	if err != nil {
		return nil, false, fmt.Errorf("encode %q: %w", d.doc.ID, err)
	}
	for attempt := 1; ; attempt++ {
		var retry bool
		failure, ok, retry, err = r.putMultipartOnce(ctx, d, names, jsonPart)
		if err == nil || !retry || attempt >= maxAttempts || ctx.Err() != nil {
			return failure, ok, err
		}
	}
}

// partHeader is the header of the part of attachment name.
func partHeader(name, contentType string) textproto.MIMEHeader {
	if contentType == "" {
		contentType = "application/octet-stream"
	}
	return textproto.MIMEHeader{
		"Content-Disposition": {mime.FormatMediaType("attachment", map[string]string{"filename": name})},
		"Content-Type":        {contentType},
	}
}

func (r *run) putMultipartOnce(ctx context.Context, d attachedDoc, names []string, jsonPart []byte) (failure *writeFailure, ok, retry bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	// The framing is computed first, with empty bodies, to send a Content-Length.
	var framing bytes.Buffer
	mw := multipart.NewWriter(&framing)
	boundary := mw.Boundary()
	jsonHeader := textproto.MIMEHeader{"Content-Type": {"application/json"}}
	if _, err := mw.CreatePart(jsonHeader); err != nil {
		return nil, false, false, err
	}
	length := int64(len(jsonPart))
	for _, n := range names {
		if _, err := mw.CreatePart(partHeader(n, d.atts[n].ContentType)); err != nil {
			return nil, false, false, err
		}
		length += d.atts[n].Length
	}
	_ = mw.Close()
	length += int64(framing.Len())

	pr, pw := io.Pipe()
	go func() {
		pw.CloseWithError(r.writeParts(ctx, pw, boundary, d, names, jsonHeader, jsonPart))
	}()
	defer pr.Close()
	req, err := r.tgt.c.NewRequest(ctx, http.MethodPut, r.tgt.docPath(d.doc.ID), url.Values{"new_edits": {"false"}}, pr)
	if err != nil {
		return nil, false, false, fmt.Errorf("build multipart put of %q: %w", d.doc.ID, err)
	}
	req.ContentLength = length
	req.Header.Set("Content-Type", mime.FormatMediaType("multipart/related", map[string]string{"boundary": boundary}))
	resp, err := r.tgt.c.Send(req)
	var se *sourceError
	var he *couch.HTTPError
	switch {
	case err == nil:
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		_ = resp.Body.Close()
		return nil, true, false, nil
	case errors.As(err, &se) && se.gone:
		return nil, false, false, nil // fetched again inline, with latest=true
	case errors.As(err, &se):
		return nil, false, se.retry, se.err
	case !errors.As(err, &he):
		return nil, false, true, fmt.Errorf("multipart put of %q to %s: %w", d.doc.ID, r.tgt.shown, err)
	case he.Status >= 500 || he.Status == http.StatusTooManyRequests:
		return nil, false, true, err
	case he.Status == http.StatusUnsupportedMediaType || he.Status == http.StatusPreconditionFailed:
		return nil, false, false, nil
	default:
		return &writeFailure{ID: d.doc.ID, Rev: d.doc.Rev, Error: he.ErrorName, Reason: he.Reason}, true, false, nil
	}
}

// sourceError is a failure to read an attachment from the source while streaming it.
type sourceError struct {
	err   error
	retry bool
	gone  bool // 404: the revision is no longer on the source
}

func (e *sourceError) Error() string { return e.err.Error() }
func (e *sourceError) Unwrap() error { return e.err }

// writeParts writes the multipart body: the JSON part, then each attachment read from the
// source, checked against its declared length.
func (r *run) writeParts(ctx context.Context, w io.Writer, boundary string, d attachedDoc, names []string, jsonHeader textproto.MIMEHeader, jsonPart []byte) error {
	mw := multipart.NewWriter(w)
	if err := mw.SetBoundary(boundary); err != nil {
		return err
	}
	pw, err := mw.CreatePart(jsonHeader)
	if err != nil {
		return err
	}
	if _, err := pw.Write(jsonPart); err != nil {
		return err
	}
	for _, n := range names {
		s := d.atts[n]
		pw, err := mw.CreatePart(partHeader(n, s.ContentType))
		if err != nil {
			return err
		}
		if err := r.copyAttachment(ctx, pw, d.doc, n, s.Length); err != nil {
			return err
		}
	}
	return mw.Close()
}

// copyAttachment copies attachment name of doc's revision from the source to w: exactly length
// bytes, else an error.
func (r *run) copyAttachment(ctx context.Context, w io.Writer, doc fetchedDoc, name string, length int64) error {
	path := r.src.docPath(doc.ID) + "/" + couchpath.Segment(name)
	req, err := r.src.c.NewRequest(ctx, http.MethodGet, path, url.Values{"rev": {doc.Rev}}, nil)
	if err != nil {
		return &sourceError{err: fmt.Errorf("build attachment request: %w", err)}
	}
	req.Header.Del("Accept")             // the attachment's own type
	resp, err := r.src.c.SendStream(req) // while the multipart PUT holds a connection of the target
	if err != nil {
		class := couch.Classify(err)
		return &sourceError{
			retry: class == couch.Transient && ctx.Err() == nil,
			gone:  class == couch.NotFound,
			err:   fmt.Errorf("read attachment from %s: %w", r.src.shown, err),
		}
	}
	defer resp.Body.Close()
	n, err := io.Copy(w, io.LimitReader(resp.Body, length+1))
	if err == nil && n != length {
		err = fmt.Errorf("attachment %q of %q: got %d bytes, want %d", name, doc.ID, n, length)
	}
	if err != nil {
		return &sourceError{retry: true, err: fmt.Errorf("copy attachment from %s: %w", r.src.shown, err)}
	}
	return nil
}

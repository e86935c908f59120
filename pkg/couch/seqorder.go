package couch

import (
	"bytes"
	"compress/zlib"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/big"
	"strconv"
	"strings"
	"sync"
)

// Covers reports whether position a of a db's changes feed includes every change that position
// b includes: a db that was at b when it was last looked at, and is at a now, has no change
// that a reader who got to a has not seen. It is false whenever the seqs alone cannot tell:
//
//   - equal seqs cover each other;
//   - integer seqs (PouchDB Server, CouchDB 1) compare as numbers;
//   - CouchDB 2+ seqs ("N-g1AAAA…") hold, packed, each shard range's copy (node), its file's
//     uuid prefix and its seq. a covers b when both name the same copies of the same ranges and
//     a's seq of each is at least b's (a range b has read nothing of, packed as a bare 0, is
//     covered by any copy). The packing's order is not part of the value: CouchDB
//     sends one state as different strings (db info's update_seq lists the shards in one order,
//     a _changes last_seq in another), which string equality would call different. Copies
//     that differ (a cluster answering from another node, a db recreated: new uuids) do not
//     cover each other.
//
// The reconciliation sweep compares a completion record with the db's update_seq this way.
func Covers(a, b Seq) bool {
	if a == b {
		return true
	}
	if x, ok := plainSeq(a); ok {
		y, ok := plainSeq(b)
		return ok && x.Cmp(y) >= 0
	}
	pa, pb, err := unpackBoth(a, b)
	if err != nil || len(pa) != len(pb) {
		return false
	}
	for r, sb := range pb {
		sa, ok := pa[r]
		if ok && sb.seq.Sign() == 0 {
			continue // nothing of this range yet (packed as a bare 0): anything covers it
		}
		if !ok || sa.node != sb.node || sa.uuid != sb.uuid || sa.seq.Cmp(sb.seq) < 0 {
			return false
		}
	}
	return true
}

// SameState reports whether a and b are seqs of one state of a db: equal, or the same copies
// at the same seqs packed in another order (each covers the other).
func SameState(a, b Seq) bool {
	return a == b || Covers(a, b) && Covers(b, a)
}

// OtherCopies reports whether a and b are CouchDB 2+ seqs that name different copies of a
// shard range (another node, or another file: a db recreated), so that Covers cannot order
// them: a cluster's coordinator picks the copies that answer per request, and one state of a
// db reads as seqs of different copies. CouchDB itself can still tell: a _changes read since a
// names a's copies and maps the others (Client.ChangedSince). False for integer seqs, for
// equal ones, and for seqs it cannot decode.
func OtherCopies(a, b Seq) bool {
	if a == b {
		return false
	}
	pa, pb, err := unpackBoth(a, b)
	if err != nil {
		return false
	}
	if len(pa) != len(pb) {
		return true
	}
	for r, sb := range pb {
		sa, ok := pa[r]
		if !ok {
			return true
		}
		if sa.seq.Sign() == 0 || sb.seq.Sign() == 0 {
			continue // nothing read of this range yet: no copy to compare
		}
		if sa.node != sb.node || sa.uuid != sb.uuid {
			return true
		}
	}
	return false
}

// FilesReplaced reports whether b, a CouchDB 2+ seq read after a, names another file than a for
// a range that a had read something of, on the same node: that node's file of the range was
// created anew since a was read — the db was deleted and created again (or that copy was
// rebuilt) — and a _changes read since a read the range from 0 of the new file. Copies of
// another node are not compared (a cluster answers from any copy). False for integer seqs and
// for seqs it cannot decode.
func FilesReplaced(a, b Seq) bool {
	pa, pb, err := unpackBoth(a, b)
	if err != nil {
		return false
	}
	for r, sb := range pb {
		sa, ok := pa[r]
		if ok && sa.seq.Sign() > 0 && sa.node == sb.node && sa.uuid != "" && sb.uuid != "" && sa.uuid != sb.uuid {
			return true
		}
	}
	return false
}

// Packed reports whether s is a CouchDB 2+ seq that names its shard copies (one that
// SameCopies can compare).
func Packed(s Seq) bool {
	_, err := unpackSeq(s)
	return err == nil
}

// SameCopies reports whether a and b are CouchDB 2+ seqs that provably name the same shard
// files of one db: both have the same ranges, each range that both have read something of
// names the same node and file uuid in both (the uuid is random per file: a db deleted and
// created again has new files for every range), and at least one range does. A range read in
// one only is not compared. False for anything it cannot decode, and for every integer seq.
//
// A _changes answer whose last_seq names the same files as the since it was asked with comes
// from the db that since was read from: CouchDB rewinds a range whose file uuid differs
// from since's to 0 (couch_db:calculate_start_seq), so an answer from a db created again
// names its new files.
func SameCopies(a, b Seq) bool {
	pa, pb, err := unpackBoth(a, b)
	if err != nil || len(pa) != len(pb) {
		return false
	}
	compared := 0
	for r, sb := range pb {
		sa, ok := pa[r]
		switch {
		case !ok:
			return false
		case sa.seq.Sign() == 0 || sb.seq.Sign() == 0:
			continue // nothing read of the range on one side: no file to compare
		case sa.node != sb.node || sa.uuid == "" || sa.uuid != sb.uuid:
			return false
		}
		compared++
	}
	return compared > 0
}

// unpackBoth unpacks two CouchDB 2+ seqs (unpackSeq).
func unpackBoth(a, b Seq) (map[shardRange]shardSeq, map[shardRange]shardSeq, error) {
	pa, err := unpackSeq(a)
	if err != nil {
		return nil, nil, err
	}
	pb, err := unpackSeq(b)
	return pa, pb, err
}

// plainSeq returns an integer seq's value (false for any other form).
func plainSeq(s Seq) (*big.Int, bool) {
	if s == "" || len(s) > 40 {
		return nil, false
	}
	for _, c := range []byte(s) {
		if c < '0' || c > '9' {
			return nil, false
		}
	}
	n, ok := new(big.Int).SetString(string(s), 10)
	return n, ok
}

// shardRange is a shard's range of the hash space, "begin-end".
type shardRange string

// shardSeq is one shard copy's position in a packed seq.
type shardSeq struct {
	node string   // the copy's node
	uuid string   // the shard file's uuid prefix ("" in seqs of releases that did not pack it)
	seq  *big.Int // the copy's update seq
}

// maxPackedSeq bounds what unpackSeq decodes, compressed and not: a seq names one copy of each
// range (q of them, 8 by default), a few hundred bytes.
const maxPackedSeq = 64 << 10

// unpackSeq decodes a CouchDB 2+ seq: "N-" then the URL-safe base64 (no padding) of an Erlang
// external term, usually zlib-compressed: a list of {Node, [Begin, End], {Seq, Uuid, EpochNode}}
// (or {Node, [Begin, End], Seq} in older releases).
func unpackSeq(s Seq) (map[shardRange]shardSeq, error) {
	str := string(s)
	if len(str) > maxPackedSeq {
		return nil, errors.New("seq too long")
	}
	num, packed, ok := strings.Cut(str, "-")
	if !ok || num == "" || packed == "" {
		return nil, errors.New("not a packed seq")
	}
	if _, err := strconv.ParseUint(num, 10, 64); err != nil {
		return nil, errors.New("not a packed seq")
	}
	raw, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(packed, "="))
	if err != nil {
		return nil, fmt.Errorf("packed seq: %w", err)
	}
	term, err := decodeExternal(raw)
	if err != nil {
		return nil, err
	}
	list, ok := term.([]any)
	if !ok || len(list) == 0 {
		return nil, errors.New("packed seq: not a list of shards")
	}
	out := make(map[shardRange]shardSeq, len(list))
	for _, e := range list {
		t, ok := e.(etfTuple)
		if !ok || len(t) != 3 {
			return nil, errors.New("packed seq: a shard is not {node, range, seq}")
		}
		node, ok1 := t[0].(etfAtom)
		rng, ok2 := t[1].([]any)
		if !ok1 || !ok2 || len(rng) != 2 {
			return nil, errors.New("packed seq: a shard's node or range is malformed")
		}
		lo, ok1 := rng[0].(*big.Int)
		hi, ok2 := rng[1].(*big.Int)
		if !ok1 || !ok2 {
			return nil, errors.New("packed seq: a shard's range is not two integers")
		}
		ss := shardSeq{node: string(node)}
		switch v := t[2].(type) {
		case *big.Int:
			ss.seq = v
		case etfTuple:
			if len(v) < 2 {
				return nil, errors.New("packed seq: a shard's seq tuple is too short")
			}
			n, ok1 := v[0].(*big.Int)
			uuid, ok2 := v[1].(etfBinary)
			if !ok1 || !ok2 {
				return nil, errors.New("packed seq: a shard's seq tuple is malformed")
			}
			ss.seq, ss.uuid = n, string(uuid)
		default:
			return nil, errors.New("packed seq: a shard's seq is malformed")
		}
		key := shardRange(lo.String() + "-" + hi.String())
		if _, dup := out[key]; dup {
			return nil, errors.New("packed seq: a range appears twice")
		}
		out[key] = ss
	}
	return out, nil
}

// The Erlang external term format, as far as packed seqs use it.
type (
	etfAtom   string
	etfBinary string
	etfTuple  []any
)

const (
	etfVersion      = 131
	etfCompressed   = 'P'
	etfSmallInt     = 'a'
	etfInt          = 'b'
	etfAtomLatin1   = 'd'
	etfSmallTuple   = 'h'
	etfLargeTuple   = 'i'
	etfNil          = 'j'
	etfString       = 'k'
	etfList         = 'l'
	etfBinaryTag    = 'm'
	etfSmallBig     = 'n'
	etfLargeBig     = 'o'
	etfSmallAtom    = 's'
	etfAtomUTF8     = 'v'
	etfSmallAtomUTF = 'w'
	etfMaxDepth     = 8
)

// decodeExternal decodes one term in Erlang's external format (term_to_binary), compressed or
// not.
func decodeExternal(b []byte) (any, error) {
	if len(b) < 2 || b[0] != etfVersion {
		return nil, errors.New("packed seq: not an Erlang term")
	}
	b = b[1:]
	if b[0] == etfCompressed {
		if len(b) < 5 {
			return nil, errors.New("packed seq: truncated")
		}
		size := binary.BigEndian.Uint32(b[1:5])
		if size > maxPackedSeq {
			return nil, errors.New("packed seq: too large")
		}
		out, err := inflate(b[5:], int(size))
		if err != nil {
			return nil, err
		}
		b = out
	}
	d := etfDecoder{b: b}
	v, err := d.term(0)
	if err != nil {
		return nil, err
	}
	if len(d.b) != 0 {
		return nil, errors.New("packed seq: trailing bytes")
	}
	return v, nil
}

// inflaters keeps zlib readers for reuse: a new one allocates its decompressor's window (tens
// of KB), which made decoding a seq cost 40 KB and 25 µs.
var inflaters sync.Pool

// inflate decompresses the zlib stream z, which must hold exactly size bytes.
func inflate(z []byte, size int) ([]byte, error) {
	var zr io.ReadCloser
	if r, ok := inflaters.Get().(io.ReadCloser); ok {
		if err := r.(zlib.Resetter).Reset(bytes.NewReader(z), nil); err != nil {
			return nil, fmt.Errorf("packed seq: %w", err)
		}
		zr = r
	} else {
		r, err := zlib.NewReader(bytes.NewReader(z))
		if err != nil {
			return nil, fmt.Errorf("packed seq: %w", err)
		}
		zr = r
	}
	out := make([]byte, size+1)
	n, err := io.ReadFull(zr, out)
	switch {
	case err == nil: // more than size bytes
		err = errors.New("packed seq: wrong uncompressed size")
	case errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF):
		err = nil
		if n != size {
			err = errors.New("packed seq: wrong uncompressed size")
		}
	default:
		err = fmt.Errorf("packed seq: %w", err)
	}
	if cerr := zr.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("packed seq: %w", cerr)
	}
	if err != nil {
		return nil, err // a reader that failed is not reused
	}
	inflaters.Put(zr)
	return out[:size], nil
}

type etfDecoder struct{ b []byte }

var errETFTruncated = errors.New("packed seq: truncated")

func (d *etfDecoder) take(n int) ([]byte, error) {
	if n < 0 || n > len(d.b) {
		return nil, errETFTruncated
	}
	out := d.b[:n]
	d.b = d.b[n:]
	return out, nil
}

func (d *etfDecoder) uint(n int) (uint32, error) {
	b, err := d.take(n)
	if err != nil {
		return 0, err
	}
	var v uint32
	for _, c := range b {
		v = v<<8 | uint32(c)
	}
	return v, nil
}

func (d *etfDecoder) term(depth int) (any, error) {
	if depth > etfMaxDepth {
		return nil, errors.New("packed seq: nested too deep")
	}
	tag, err := d.uint(1)
	if err != nil {
		return nil, err
	}
	switch tag {
	case etfSmallInt:
		v, err := d.uint(1)
		return big.NewInt(int64(v)), err
	case etfInt:
		v, err := d.uint(4)
		return big.NewInt(int64(int32(v))), err
	case etfSmallBig, etfLargeBig:
		width := 1
		if tag == etfLargeBig {
			width = 4
		}
		n, err := d.uint(width)
		if err != nil {
			return nil, err
		}
		if n > 64 {
			return nil, errors.New("packed seq: integer too large")
		}
		sign, err := d.uint(1)
		if err != nil {
			return nil, err
		}
		le, err := d.take(int(n))
		if err != nil {
			return nil, err
		}
		be := make([]byte, len(le))
		for i, c := range le {
			be[len(le)-1-i] = c
		}
		v := new(big.Int).SetBytes(be)
		if sign != 0 {
			v.Neg(v)
		}
		return v, nil
	case etfAtomLatin1, etfAtomUTF8, etfSmallAtom, etfSmallAtomUTF:
		width := 2
		if tag == etfSmallAtom || tag == etfSmallAtomUTF {
			width = 1
		}
		n, err := d.uint(width)
		if err != nil {
			return nil, err
		}
		b, err := d.take(int(n))
		return etfAtom(b), err
	case etfBinaryTag:
		n, err := d.uint(4)
		if err != nil {
			return nil, err
		}
		b, err := d.take(int(min(n, maxPackedSeq+1)))
		return etfBinary(b), err
	case etfString: // a list of small integers
		n, err := d.uint(2)
		if err != nil {
			return nil, err
		}
		b, err := d.take(int(n))
		if err != nil {
			return nil, err
		}
		out := make([]any, len(b))
		for i, c := range b {
			out[i] = big.NewInt(int64(c))
		}
		return out, nil
	case etfNil:
		return []any{}, nil
	case etfSmallTuple, etfLargeTuple, etfList:
		width := 1
		if tag != etfSmallTuple {
			width = 4
		}
		n, err := d.uint(width)
		if err != nil {
			return nil, err
		}
		if int(n) > len(d.b) { // every element takes a byte at least
			return nil, errETFTruncated
		}
		out := make([]any, 0, n)
		for range n {
			v, err := d.term(depth + 1)
			if err != nil {
				return nil, err
			}
			out = append(out, v)
		}
		if tag != etfList {
			return etfTuple(out), nil
		}
		tail, err := d.term(depth + 1) // a proper list ends in nil
		if err != nil {
			return nil, err
		}
		if t, ok := tail.([]any); !ok || len(t) != 0 {
			return nil, errors.New("packed seq: improper list")
		}
		return out, nil
	default:
		return nil, fmt.Errorf("packed seq: unexpected term tag %d", tag)
	}
}

package couch

import (
	"bytes"
	"compress/zlib"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Seqs recorded from Apache CouchDB 3.3.3 (single node, q=2): one db with three docs, read as
// GET /{db}'s update_seq and as _changes' last_seq (the same state, its shards packed in the
// other order), and _changes?limit=2's last_seq (two of the three changes).
const (
	couch333Info     = "3-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVB4LkGRoAFL_gSArgzmRIRcowG5iYZximpSKTR8e0xIZkuqhxjCDjUm2tLBMM7HEpiELAO-qKGg"
	couch333Changes  = "3-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXOBAuzJlhaWaSaW2DTgMSaPBUgyNACp_1DTGMCmmVgYp5gmpWLTlwUAHe0oaA"
	couch333Limit2   = "2-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuzJlhaWaSaW2DTgMSaPBUgyNACp_yDTEhmyAFHzIEc"
	cluster35Info    = "5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQeC5BkaABS_4EgK4M5kTkXKMCebGmSapiWhKkLp0mJDEn1UCOYwEaYGBiZpiZbYirPAgA6DiR5"
	cluster35Changes = "5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQiQ1L9____szKYE5lygQLsJgZGpqnJlpjKcRqRxwIkGRqA1H-oScxgk5ItTVIN05IwdWUBAEvkJHk"
)

// One state of one db (five docs) on the three-node CouchDB 3.5.2 cluster (n=3, q=2): GET /{db}
// through one node, three answers naming three different sets of shard copies. A _changes
// read since any of them has no row; after a sixth write, each has one.
var clusterCopies = []Seq{
	"5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQeC5BkaABS_4EgK4M5kTEXKMBuapFoaWCWjKkLp0mJDEn1UCNYwEYkJhkkmSeaYirPAgAhXCRx",
	"5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV2MDQy1zMAQsMckEQeC5BkaABS_4EgK4M5kTEXKMBukZSYlpyWjKkLp0mJDEn1UCNYwEZYppmnmJmbYCrPAgBfXCTv",
	"5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQeC5BkaABS_4EgK4M5kTEXKMCeZGBhkWphjKkLbpIhmkmJDEn1UCNYwEYkJhkkmSeaYirPAgAjiSR1",
}

func TestCoversRecordedSeqs(t *testing.T) {
	for _, tc := range []struct {
		name string
		a, b Seq
		want bool
	}{
		{"db info and _changes of one state, CouchDB 3.3", couch333Info, couch333Changes, true},
		{"the same, the other way", couch333Changes, couch333Info, true},
		{"three changes cover two", couch333Info, couch333Limit2, true},
		{"two changes do not cover three", couch333Limit2, couch333Info, false},
		{"db info and _changes of one state, CouchDB 3.5 cluster", cluster35Info, cluster35Changes, true},
		{"another db's copies (other uuids)", cluster35Info, couch333Info, false},
		{"integers", "12", "7", true},
		{"integers, behind", "7", "12", false},
		{"equal strings", "anything", "anything", true},
		{"an integer and a packed seq", "3", couch333Info, false},
		{"unreadable", "3-!!", "3-!!x", false},
		{"empty", "", "0", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, Covers(tc.a, tc.b))
		})
	}
}

// shard is one entry of a seq built by packSeq.
type shard struct {
	node       string
	lo, hi     uint32
	seq        uint64
	uuid       string // "" packs the old form {Node, Range, Seq}
	compressed bool
}

// packSeq builds a CouchDB 2+ seq the way CouchDB packs it (term_to_binary, compressed when
// asked, URL-safe base64).
func packSeq(sum int, shards ...shard) Seq {
	var b bytes.Buffer
	atom := func(s string) {
		b.WriteByte('d')
		_ = binary.Write(&b, binary.BigEndian, uint16(len(s)))
		b.WriteString(s)
	}
	integer := func(v uint64) {
		switch {
		case v < 256:
			b.WriteByte('a')
			b.WriteByte(byte(v))
		case v < 1<<31:
			b.WriteByte('b')
			_ = binary.Write(&b, binary.BigEndian, uint32(v))
		default:
			b.Write([]byte{'n', 8, 0})
			_ = binary.Write(&b, binary.LittleEndian, v)
		}
	}
	b.WriteByte('l')
	_ = binary.Write(&b, binary.BigEndian, uint32(len(shards)))
	for _, s := range shards {
		b.Write([]byte{'h', 3})
		atom(s.node)
		b.WriteByte('l')
		_ = binary.Write(&b, binary.BigEndian, uint32(2))
		integer(uint64(s.lo))
		integer(uint64(s.hi))
		b.WriteByte('j')
		if s.uuid == "" {
			integer(s.seq)
			continue
		}
		b.Write([]byte{'h', 3})
		integer(s.seq)
		b.WriteByte('m')
		_ = binary.Write(&b, binary.BigEndian, uint32(len(s.uuid)))
		b.WriteString(s.uuid)
		atom(s.node)
	}
	b.WriteByte('j')
	term := append([]byte{131}, b.Bytes()...)
	if len(shards) > 0 && shards[0].compressed {
		var z bytes.Buffer
		zw := zlib.NewWriter(&z)
		_, _ = zw.Write(b.Bytes())
		_ = zw.Close()
		term = append([]byte{131, 'P'}, binary.BigEndian.AppendUint32(nil, uint32(b.Len()))...)
		term = append(term, z.Bytes()...)
	}
	return Seq(fmt.Sprintf("%d-%s", sum, base64.RawURLEncoding.EncodeToString(term)))
}

func TestCoversPackedSeqs(t *testing.T) {
	a1 := shard{node: "node1@127.0.0.1", lo: 0, hi: 0x7fffffff, seq: 3, uuid: "c989f49d"}
	a2 := shard{node: "node1@127.0.0.1", lo: 0x80000000, hi: 0xffffffff, seq: 5, uuid: "483d5bed"}
	ahead := a2
	ahead.seq = 1 << 40 // a big integer
	otherNode := a2
	otherNode.node = "node2@127.0.0.1"
	otherUUID := a2
	otherUUID.uuid = "00000000"
	old1, old2 := a1, a2
	old1.uuid, old2.uuid = "", ""
	zipped := a1
	zipped.compressed = true

	assert.True(t, Covers(packSeq(8, a1, a2), packSeq(8, a2, a1)), "order of the shards")
	assert.True(t, Covers(packSeq(8, zipped, a2), packSeq(8, a2, a1)), "compressed and not")
	assert.True(t, Covers(packSeq(9, a1, ahead), packSeq(8, a1, a2)))
	assert.False(t, Covers(packSeq(8, a1, a2), packSeq(9, a1, ahead)))
	assert.False(t, Covers(packSeq(8, a1, otherNode), packSeq(8, a1, a2)), "another copy of a range")
	assert.False(t, Covers(packSeq(8, a1, otherUUID), packSeq(8, a1, a2)), "a recreated db")
	assert.False(t, Covers(packSeq(3, a1), packSeq(8, a1, a2)), "fewer ranges")
	assert.False(t, Covers(packSeq(8, a1, a2), packSeq(3, a1)), "more ranges")
	assert.True(t, Covers(packSeq(8, old1, old2), packSeq(8, old2, old1)), "seqs without uuids")
	none := shard{node: "node2@127.0.0.1", lo: 0x80000000, hi: 0xffffffff} // read nothing of the range yet
	assert.True(t, Covers(packSeq(8, a1, a2), packSeq(3, a1, none)), "a range read nothing of")
	assert.False(t, Covers(packSeq(3, a1, none), packSeq(8, a1, a2)))
	_, err := unpackSeq(packSeq(8, a1, a1))
	require.ErrorContains(t, err, "a range appears twice")
}

func TestOtherCopies(t *testing.T) {
	for i, a := range clusterCopies {
		for j, b := range clusterCopies {
			assert.Equal(t, i != j, OtherCopies(a, b), "cluster answers %d and %d", i, j)
			assert.Equal(t, i == j, Covers(a, b), "cluster answers %d and %d", i, j)
		}
	}
	assert.False(t, OtherCopies(couch333Info, couch333Changes), "one node's copies in another order")
	assert.False(t, OtherCopies(couch333Limit2, couch333Info), "the same copies, later")
	assert.False(t, OtherCopies(cluster35Info, cluster35Changes))
	assert.True(t, OtherCopies(cluster35Info, couch333Info), "another db's copies")
	assert.False(t, OtherCopies("7", "12"), "integers are ordered")
	assert.False(t, OtherCopies("3-!!", couch333Info), "unreadable")

	a1 := shard{node: "node1@127.0.0.1", lo: 0, hi: 0x7fffffff, seq: 3, uuid: "c989f49d"}
	a2 := shard{node: "node1@127.0.0.1", lo: 0x80000000, hi: 0xffffffff, seq: 5, uuid: "483d5bed"}
	otherNode, otherUUID := a2, a2
	otherNode.node, otherUUID.uuid = "node2@127.0.0.1", "00000000"
	none := shard{node: "node2@127.0.0.1", lo: 0x80000000, hi: 0xffffffff}
	assert.True(t, OtherCopies(packSeq(8, a1, otherNode), packSeq(8, a1, a2)))
	assert.True(t, OtherCopies(packSeq(8, a1, otherUUID), packSeq(8, a1, a2)), "a recreated db")
	assert.True(t, OtherCopies(packSeq(3, a1), packSeq(8, a1, a2)), "fewer ranges")
	assert.False(t, OtherCopies(packSeq(3, a1, none), packSeq(8, a1, a2)), "a range read nothing of names no copy")
}

func TestSameCopies(t *testing.T) {
	assert.True(t, SameCopies(couch333Info, couch333Changes), "one node's copies in another order")
	assert.True(t, SameCopies(couch333Limit2, couch333Info), "the same files, later")
	assert.True(t, SameCopies(cluster35Info, cluster35Changes))
	assert.False(t, SameCopies(cluster35Info, couch333Info), "another db's files")
	for i, a := range clusterCopies {
		for j, b := range clusterCopies {
			assert.Equal(t, i == j, SameCopies(a, b), "cluster answers %d and %d", i, j)
		}
	}
	assert.False(t, SameCopies("7", "7"), "integers name no files")
	assert.False(t, SameCopies("3-!!", "3-!!"), "unreadable")

	a1 := shard{node: "node1@127.0.0.1", lo: 0, hi: 0x7fffffff, seq: 3, uuid: "c989f49d"}
	a2 := shard{node: "node1@127.0.0.1", lo: 0x80000000, hi: 0xffffffff, seq: 5, uuid: "483d5bed"}
	recreated := a2
	recreated.uuid = "00000000"
	none := shard{node: "node1@127.0.0.1", lo: 0x80000000, hi: 0xffffffff}
	none1 := shard{node: "node1@127.0.0.1", lo: 0, hi: 0x7fffffff}
	old1, old2 := a1, a2
	old1.uuid, old2.uuid = "", ""
	assert.True(t, SameCopies(packSeq(8, a1, a2), packSeq(8, a2, a1)))
	assert.False(t, SameCopies(packSeq(8, a1, recreated), packSeq(8, a1, a2)), "a file created again")
	assert.True(t, SameCopies(packSeq(3, a1, none), packSeq(3, a1, none)), "a range read nothing of in both")
	assert.True(t, SameCopies(packSeq(3, a1, none), packSeq(8, a1, a2)), "a range read in one only is not compared")
	assert.False(t, SameCopies(packSeq(3, none1, a2), packSeq(8, a1, recreated)), "the only range compared is another file")
	assert.False(t, SameCopies(packSeq(0, none1, none), packSeq(0, none1, none)), "nothing read: nothing to compare")
	assert.False(t, SameCopies(packSeq(8, old1, old2), packSeq(8, old1, old2)), "seqs without file uuids")
	assert.True(t, Packed(couch333Info))
	assert.False(t, Packed("12"))
}

func TestFilesReplaced(t *testing.T) {
	a1 := shard{node: "node1@127.0.0.1", lo: 0, hi: 0x7fffffff, seq: 3, uuid: "c989f49d"}
	a2 := shard{node: "node1@127.0.0.1", lo: 0x80000000, hi: 0xffffffff, seq: 5, uuid: "483d5bed"}
	recreated := a2
	recreated.uuid, recreated.seq = "00000000", 1
	elsewhere := recreated
	elsewhere.node = "node2@127.0.0.1"
	none := shard{node: "node1@127.0.0.1", lo: 0x80000000, hi: 0xffffffff}
	assert.True(t, FilesReplaced(packSeq(8, a1, a2), packSeq(4, a1, recreated)), "a file created again on the same node")
	assert.False(t, FilesReplaced(packSeq(8, a1, a2), packSeq(9, a2, a1)), "the same files, later")
	assert.False(t, FilesReplaced(packSeq(8, a1, a2), packSeq(4, a1, elsewhere)), "another node's copy: not compared")
	assert.False(t, FilesReplaced(packSeq(3, a1, none), packSeq(4, a1, recreated)), "nothing read of the range before")
	assert.False(t, FilesReplaced(couch333Info, couch333Changes), "one node's copies in another order")
	assert.False(t, FilesReplaced(cluster35Info, cluster35Changes))
	assert.False(t, FilesReplaced("7", "3"), "integers name no files")
}

func FuzzCovers(f *testing.F) {
	for _, s := range []string{couch333Info, couch333Changes, couch333Limit2, cluster35Info, cluster35Changes, "12", "", "3-g1AAAA"} {
		f.Add(s, couch333Info)
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		assert.True(t, Covers(Seq(a), Seq(a)), "a seq covers itself")
		assert.False(t, OtherCopies(Seq(a), Seq(a)), "a seq names its own copies")
		assert.False(t, FilesReplaced(Seq(a), Seq(a)), "a seq names its own files")
		if SameCopies(Seq(a), Seq(b)) {
			assert.False(t, OtherCopies(Seq(a), Seq(b)), "the same copies are not other copies")
			assert.True(t, SameCopies(Seq(b), Seq(a)), "the same copies both ways")
		}
		if OtherCopies(Seq(a), Seq(b)) {
			assert.False(t, Covers(Seq(a), Seq(b)), "seqs of other copies are not ordered")
			assert.True(t, OtherCopies(Seq(b), Seq(a)), "other copies both ways")
		}
		if Covers(Seq(a), Seq(b)) && Covers(Seq(b), Seq(a)) && a != b {
			// Two seqs covering each other name one state: a third covers both or neither.
			for _, c := range []Seq{couch333Info, couch333Limit2, "12"} {
				assert.Equal(t, Covers(c, Seq(a)), Covers(c, Seq(b)))
			}
		}
	})
}

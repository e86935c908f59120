package admin

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/spiegel-nats/spiegel/pkg/rules"
)

// RuleFileDoc is one rule doc read from a file by ReadRuleFiles (`producer rules apply` and
// `validate`).
type RuleFileDoc struct {
	File string
	ID   string
	// Doc is the doc as written, without "_rev" (apply handles revisions itself); numbers are
	// json.Number, so they are written back with the text they had.
	Doc map[string]any
	// Rule is the compiled rule (CheckRuleDocs sets it for a valid doc).
	Rule rules.Rule
}

// RuleProblem says why a doc of a rule file cannot be applied: the file, the rule id (or its
// position in the file when it has none), the field ("" for the whole doc) and the reason. It
// never quotes a URL.
type RuleProblem struct {
	File   string `json:"file"`
	Where  string `json:"where,omitempty"` // "doc #2" of a file holding an array, when it has no id
	ID     string `json:"id,omitempty"`
	Field  string `json:"field,omitempty"`
	Reason string `json:"error"`
}

// Error returns `<file>: rule "<id>": field "<field>": <reason>`, leaving out what is unknown.
func (p RuleProblem) Error() string { return p.File + ": " + p.detail() }

// detail is Error without the file.
func (p RuleProblem) detail() string {
	s := ""
	if p.ID != "" {
		s += fmt.Sprintf("rule %q: ", p.ID)
	} else if p.Where != "" {
		s += p.Where + ": "
	}
	if p.Field != "" {
		s += fmt.Sprintf("field %q: ", p.Field)
	}
	return s + p.Reason
}

// ReadRuleFiles reads rule docs from files: each holds one rule doc (a JSON object) or a JSON
// array of rule docs, each with a string "_id". It returns the docs it could read in file order
// and a problem for each file or doc it could not (bad JSON, no _id, an _id given twice); it
// does not check the docs themselves (CheckRuleDocs does).
func ReadRuleFiles(paths []string) ([]RuleFileDoc, []RuleProblem) {
	var docs []RuleFileDoc
	var problems []RuleProblem
	seen := map[string]string{} // id → file
	for _, path := range paths {
		raws, isArray, err := readRuleFile(path)
		if err != nil {
			problems = append(problems, RuleProblem{File: path, Reason: err.Error()})
			continue
		}
		for i, raw := range raws {
			where := ""
			if isArray {
				where = fmt.Sprintf("doc #%d", i+1)
			}
			d, p := decodeRuleDoc(path, where, raw)
			if p != nil {
				problems = append(problems, *p)
				continue
			}
			if other, dup := seen[d.ID]; dup {
				problems = append(problems, RuleProblem{File: path, ID: d.ID, Field: "_id",
					Reason: "given twice (also in " + other + "): each rule is applied from one place"})
				continue
			}
			seen[d.ID] = path
			docs = append(docs, d)
		}
	}
	return docs, problems
}

// readRuleFile returns the raw docs of one file: the object, or the elements of the array
// (isArray).
func readRuleFile(path string) (raws []json.RawMessage, isArray bool, err error) {
	data, err := os.ReadFile(path)
	if err != nil {
		var pe *os.PathError
		if errors.As(err, &pe) {
			err = pe.Err // the path is the problem's File already
		}
		return nil, false, fmt.Errorf("read: %w", err)
	}
	data = bytes.TrimSpace(data)
	if len(data) == 0 {
		return nil, false, errors.New("empty file: want a rule doc or a JSON array of rule docs")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	isArray = data[0] == '['
	if isArray {
		err = dec.Decode(&raws)
	} else {
		var one json.RawMessage
		err = dec.Decode(&one)
		raws = []json.RawMessage{one}
	}
	if err != nil {
		return nil, false, fmt.Errorf("invalid JSON: %s", jsonErrorText(err))
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, false, errors.New("invalid JSON: trailing data after the document")
	}
	return raws, isArray, nil
}

// decodeRuleDoc decodes one doc of a file (numbers as json.Number) and takes its _id; where
// says which doc of the file it is ("doc #2") when the file holds an array.
func decodeRuleDoc(path, where string, raw json.RawMessage) (RuleFileDoc, *RuleProblem) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var doc map[string]any
	if err := dec.Decode(&doc); err != nil || doc == nil {
		return RuleFileDoc{}, &RuleProblem{File: path, Where: where, Reason: "not a JSON object (want a rule doc)"}
	}
	id, ok := doc["_id"].(string)
	if !ok || id == "" {
		return RuleFileDoc{}, &RuleProblem{File: path, Where: where, Field: "_id",
			Reason: "required: every rule doc in a file names its id"}
	}
	delete(doc, "_rev")
	return RuleFileDoc{File: path, ID: id, Doc: doc}, nil
}

// CheckRuleDocs checks every doc with the parser the consumers use (rules.ParseWith under p),
// sets the Rule of each valid doc and returns a problem per invalid one. A doc that the
// service would ignore (a reserved id, a type other than replicator and on_change) is a problem
// too: applying it would do nothing.
func CheckRuleDocs(docs []RuleFileDoc, p rules.Policy) []RuleProblem {
	var problems []RuleProblem
	for i := range docs {
		d := &docs[i]
		raw, err := json.Marshal(d.Doc)
		if err != nil {
			problems = append(problems, RuleProblem{File: d.File, ID: d.ID, Reason: "cannot encode: " + err.Error()})
			continue
		}
		r, err := rules.ParseWith(d.ID, raw, p)
		if err == nil {
			d.Rule = r
			continue
		}
		problems = append(problems, problemOf(d.File, d.ID, d.Doc, err))
	}
	return problems
}

// problemOf turns a rules.ParseWith error about doc id of file into a RuleProblem.
func problemOf(file, id string, doc map[string]any, err error) RuleProblem {
	p := RuleProblem{File: file, ID: id}
	var ve *rules.ValidationError
	switch {
	case errors.As(err, &ve):
		p.Field, p.Reason = ve.Field, ve.Reason
	case errors.Is(err, rules.ErrNotRule) && rules.IsServiceDocID(id):
		p.Field = "_id"
		p.Reason = "reserved: ids starting with _ or " + rules.CheckpointIDPrefix + ", and " + rules.ProducerSeqID + ", are never rules"
	case errors.Is(err, rules.ErrNotRule):
		p.Field = "type"
		p.Reason = fmt.Sprintf("must be %q or %q (the service ignores any other doc)", rules.KindReplicator, rules.KindOnChange)
		if _, ok := doc["type"]; !ok {
			p.Reason = "required: " + p.Reason
		}
	default:
		p.Reason = err.Error()
	}
	return p
}

// jsonErrorText describes a decoding error without quoting the input, which may hold a secret.
func jsonErrorText(err error) string {
	var syn *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case errors.As(err, &syn):
		return fmt.Sprintf("syntax error at byte offset %d", syn.Offset)
	case errors.As(err, &typ):
		return fmt.Sprintf("a %s at byte offset %d, want a rule doc (an object) or an array of them", typ.Value, typ.Offset)
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "unexpected end of the file"
	}
	return "cannot decode"
}

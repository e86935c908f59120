// Package schema holds the JSON Schema (draft 2020-12) of rule docs, for editors and CI checks
// of rule files. The parser in pkg/rules, which the consumers and `producer rules validate`
// use, has the last word: every doc it accepts validates against the schema, and the schema
// rejects, for the same field, the invalid docs its structure can describe (a test checks
// both); regexes, Mango selectors and the installation's subject policy only the parser checks.
package schema

import _ "embed"

// ruleSchema is rule.schema.json.
//
//go:embed rule.schema.json
var ruleSchema []byte

// ID is the schema's $id.
const ID = "https://github.com/spiegel-nats/spiegel/pkg/rules/schema/rule.schema.json"

// Rule returns the JSON Schema of a rule doc (a copy: callers may keep or change it).
func Rule() []byte { return append([]byte(nil), ruleSchema...) }

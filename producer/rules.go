package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/rules"
)

const rulesHelp = `producer rules list|get|apply|delete|validate — manage rules as code: keep rule docs in
files under version control, check them in CI, apply them to the spiegel db.
  list               every doc of the spiegel db (design docs and the service's own docs aside)
  get ID             one rule doc as stored
  apply FILE...      create or update the rule docs of the files (validated first; all or nothing)
  delete ID          delete a rule doc
  validate FILE...   check rule files offline (no CouchDB, no NATS, no configuration)
Run producer rules SUBCOMMAND --help for its flags. A rule file holds one rule doc (a JSON object)
or a JSON array of them, each with its "_id"; every doc is checked with the parser the consumers
use. Exit status: 0 done, 1 failed (an invalid rule, a missing rule, a server problem), 2 a bad
command line.`

// rulesSub is a subcommand of `producer rules`.
type rulesSub struct {
	args, about string
	offline     bool // needs no configuration and no server
	// flags defines the subcommand's flags on fs.
	flags func(fs *flag.FlagSet, o *rulesOpts)
	run   func(ctx context.Context, db *admin.RulesDB, cfg *config.Producer, o *rulesOpts, cio cmdIO) error
}

// rulesOpts are the flags and arguments of one `producer rules` run.
type rulesOpts struct {
	json, dryRun  bool
	subjectPrefix string
	args          []string
}

func jsonFlag(fs *flag.FlagSet, o *rulesOpts) {
	fs.BoolVar(&o.json, "json", false, "print JSON")
}

var rulesSubs = map[string]rulesSub{
	"list": {args: "", flags: jsonFlag, run: rulesList, about: `print every doc of the spiegel db (design docs and the
  service's own docs aside): id, kind, enabled, db_name pattern, destination (replicator: source →
  target; on_change: url, subject or mirror; URLs without passwords) and whether the consumers
  accept it, with the reason (field and why) when they skip it. --json: an array of objects with
  the fields id, kind, enabled, db_name, source, target, url, subject, mirror, valid, error.`},
	"get": {args: "ID", flags: jsonFlag, run: rulesGet, about: `print the rule doc ID as stored, with its _id, as indented
  JSON without _rev: what apply takes back. --json: one line, _rev included. Passwords in URLs
  are shown as xxxxx. Exits 1 when there is no such rule.`},
	"apply": {args: "FILE...", run: rulesApply, flags: func(fs *flag.FlagSet, o *rulesOpts) {
		fs.BoolVar(&o.dryRun, "dry-run", false, "show what would be created or updated; write nothing")
		jsonFlag(fs, o)
	}, about: `create or update the rule docs of the files, by _id. Each file holds one rule
  doc or a JSON array of rule docs, each with its "_id" ("_rev" is ignored: apply reads the stored
  revision itself, and reads it again when a concurrent write moved it). First every doc is
  checked with the consumers' parser; if any is invalid, nothing is written and each problem is
  printed with its file, rule id and field. Then one line per rule: created, updated (with the
  fields that changed) or unchanged (the stored doc is the same but for _rev). Rules that are in
  the spiegel db but in none of the files are left alone. --json: an array of objects with id,
  file, action, changed, rev, dry_run.`},
	"delete": {args: "ID", flags: jsonFlag, run: rulesDelete, about: `delete the rule doc ID (at its current revision).
  Exits 1 when there is no such rule. --json: {"id", "deleted", "rev"}.`},
	"validate": {args: "FILE...", offline: true, run: rulesValidate, flags: func(fs *flag.FlagSet, o *rulesOpts) {
		fs.StringVar(&o.subjectPrefix, "subject-prefix", events.DefaultPrefix, "the installation's SPIEGEL_SUBJECT_PREFIX (subject rules may not publish into its service subjects)")
		jsonFlag(fs, o)
	}, about: `check rule files with the consumers' parser, offline: it needs no CouchDB, no NATS
  and no SPIEGEL_* variable. Prints OK per rule, or the problem with its file, rule id and field;
  exits 1 when any doc is invalid. --json: an array of objects with file, id, valid, field, error.`},
}

// rulesEnv are the variables the rules commands that talk to CouchDB read.
var rulesEnv = []string{"SPIEGEL_COUCHDB_URL", "SPIEGEL_COUCHDB_CA_FILE", "SPIEGEL_COUCHDB_INSECURE_SKIP_VERIFY",
	"SPIEGEL_COUCHDB_TIMEOUT", "SPIEGEL_DB_NAME", "SPIEGEL_SUBJECT_PREFIX", "SPIEGEL_ADMIN_TIMEOUT"}

// runRules is `producer rules SUBCOMMAND [flags] [args]`.
func runRules(ctx context.Context, cfg *config.Producer, log *logrus.Logger, cio cmdIO) error {
	name, sub, o, err := parseRules(cio.args)
	if errors.Is(err, flag.ErrHelp) {
		printRulesHelp(cio.stdout, name)
		return nil
	}
	if err != nil {
		return err
	}
	if sub.offline {
		return sub.run(ctx, nil, cfg, o, cio)
	}
	db, err := admin.OpenRulesDB(ctx, cfg, log)
	if err != nil {
		return err
	}
	return sub.run(ctx, db, cfg, o, cio)
}

// parseRules parses the subcommand, its flags (anywhere among its arguments, until "--") and
// its arguments. It returns flag.ErrHelp when help was asked for, a usageError for a bad
// command line.
func parseRules(args []string) (string, rulesSub, *rulesOpts, error) {
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		if len(args) > 0 && isHelpFlag(args[0]) {
			return "", rulesSub{}, nil, flag.ErrHelp
		}
		if len(args) > 0 {
			return "", rulesSub{}, nil, usageError{fmt.Errorf("%s; want a subcommand: list, get, apply, delete or validate (see producer rules --help)", config.UnknownArg(args[0]))}
		}
		return "", rulesSub{}, nil, usageError{errors.New("want a subcommand: list, get, apply, delete or validate (see producer rules --help)")}
	}
	name := args[0]
	sub, ok := rulesSubs[name]
	if !ok {
		return "", rulesSub{}, nil, usageError{fmt.Errorf("unknown command %q: want list, get, apply, delete or validate", name)}
	}
	o := &rulesOpts{}
	fs := rulesFlagSet(name, sub, o)
	rest := args[1:]
	for {
		if err := fs.Parse(rest); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return name, sub, nil, err
			}
			return name, sub, nil, usageError{fmt.Errorf("%s: %w (see producer rules %s --help)", name, flagError(err), name)}
		}
		left := fs.Args()
		if len(left) == 0 {
			break
		}
		if len(rest) > len(left) && rest[len(rest)-len(left)-1] == "--" {
			o.args = append(o.args, left...) // after "--", everything is an argument
			break
		}
		o.args, rest = append(o.args, left[0]), left[1:]
	}
	switch {
	case sub.args == "" && len(o.args) > 0:
		return name, sub, nil, usageError{fmt.Errorf("%s: unexpected arguments %q", name, o.args)}
	case sub.args == "ID" && len(o.args) != 1:
		return name, sub, nil, usageError{fmt.Errorf("%s: want one rule id, got %d arguments", name, len(o.args))}
	case sub.args == "FILE..." && len(o.args) == 0:
		return name, sub, nil, usageError{fmt.Errorf("%s: want one or more rule files", name)}
	}
	return name, sub, o, nil
}

func rulesFlagSet(name string, sub rulesSub, o *rulesOpts) *flag.FlagSet {
	fs := flag.NewFlagSet("rules "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // the error names the flag; --help prints the flags
	fs.Usage = func() {}
	sub.flags(fs, o)
	return fs
}

func isHelpFlag(a string) bool { return a == "--help" || a == "-h" || a == "-help" }

// printRulesHelp prints the help of subcommand name ("": of `producer rules`): what it does,
// its flags with their defaults and the variables it reads.
func printRulesHelp(w io.Writer, name string) {
	sub, ok := rulesSubs[name]
	if !ok {
		fmt.Fprintf(w, "%s\n\n", rulesHelp)
		printRulesEnv(w)
		return
	}
	fmt.Fprintf(w, "producer rules %s\n  %s\n\nFlags:\n", strings.TrimSpace(name+" [flags] "+sub.args), sub.about)
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	rulesFlagSet(name, sub, &rulesOpts{}).VisitAll(func(f *flag.Flag) {
		fmt.Fprintf(tw, "  --%s\t(default %s)\t%s\n", f.Name, f.DefValue, f.Usage)
	})
	if !sub.offline {
		fmt.Fprintf(tw, "  --timeout\t(default 15s, SPIEGEL_ADMIN_TIMEOUT)\thow long to wait for CouchDB\n")
	}
	fmt.Fprintf(tw, "  --help\t\tthis help\n")
	_ = tw.Flush()
	if !sub.offline {
		fmt.Fprintln(w)
		printRulesEnv(w)
	}
}

// printRulesEnv prints the variables (rulesEnv) the rules commands read, with their defaults.
func printRulesEnv(w io.Writer) {
	fmt.Fprintln(w, "Environment (all but validate):")
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	for _, v := range config.Vars(&config.Producer{}) {
		if !slices.Contains(rulesEnv, v.Name) {
			continue
		}
		def := v.Default
		if v.Required {
			def = "(required)"
		} else if def == "" {
			def = "-"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", v.Name, def, v.Description)
	}
	_ = tw.Flush()
}

// rulesWithoutConfig runs what `producer rules` does before the configuration is loaded: every
// --help, every bad command line (exit 2, whether the configuration is complete or not), and
// validate, which needs no configuration. done is false for the rest.
func rulesWithoutConfig(ctx context.Context, args []string, stdout, stderr io.Writer) (code int, done bool) {
	if slices.ContainsFunc(args, func(a string) bool { return a == "--version" || a == "-version" }) {
		return 0, false
	}
	if _, sub, _, err := parseRules(args); err == nil && !sub.offline {
		return 0, false
	}
	err := runRules(ctx, &config.Producer{}, discardLogger(), cmdIO{args: args, stdin: strings.NewReader(""), stdout: stdout, stderr: stderr})
	if err == nil {
		return 0, true
	}
	fmt.Fprintf(stderr, "producer rules: %v\n", err)
	var uerr usageError
	if errors.As(err, &uerr) {
		return 2, true
	}
	return 1, true
}

// printJSON prints v as indented JSON.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func rulesPolicy(cfg *config.Producer) rules.Policy {
	return rules.Policy{SubjectPrefix: cfg.SubjectPrefix}
}

func rulesList(ctx context.Context, db *admin.RulesDB, cfg *config.Producer, o *rulesOpts, cio cmdIO) error {
	list, err := db.ListRules(ctx, rulesPolicy(cfg))
	if err != nil {
		return err
	}
	if o.json {
		return printJSON(cio.stdout, list)
	}
	if len(list) == 0 {
		fmt.Fprintf(cio.stdout, "no rules in the spiegel db %s\n", db.Name)
		return nil
	}
	w := tabwriter.NewWriter(cio.stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(w, "ID\tKIND\tENABLED\tDB_NAME\tDESTINATION\tVALID")
	for _, r := range list {
		dest := r.URL
		switch {
		case r.Kind == rules.KindReplicator:
			dest = r.Source + " → " + r.Target
		case r.Subject != "":
			dest = "subject " + r.Subject
		case r.Mirror != "":
			dest = "mirror " + r.Mirror
		}
		valid := "yes"
		if !r.Valid {
			valid = "no: " + r.Error
		}
		fmt.Fprintf(w, "%s\t%s\t%t\t%s\t%s\t%s\n", r.ID, orDash(r.Kind), r.Enabled, orDash(r.DBName), orDash(dest), valid)
	}
	return w.Flush()
}

func rulesGet(ctx context.Context, db *admin.RulesDB, _ *config.Producer, o *rulesOpts, cio cmdIO) error {
	doc, err := db.GetRule(ctx, o.args[0])
	if err != nil {
		return err
	}
	if o.json {
		return json.NewEncoder(cio.stdout).Encode(doc)
	}
	delete(doc, "_rev")
	return printJSON(cio.stdout, doc)
}

func rulesDelete(ctx context.Context, db *admin.RulesDB, _ *config.Producer, o *rulesOpts, cio cmdIO) error {
	rev, err := db.DeleteRule(ctx, o.args[0])
	if err != nil {
		return err
	}
	if o.json {
		return printJSON(cio.stdout, map[string]any{"id": o.args[0], "deleted": true, "rev": rev})
	}
	fmt.Fprintf(cio.stdout, "deleted %s\n", o.args[0])
	return nil
}

// readAndCheck reads the rule files and checks every doc under p. It returns the docs read,
// the problems found (with the files, then with the docs) and an error saying how many of how
// many docs are invalid, or nil.
func readAndCheck(paths []string, p rules.Policy) ([]admin.RuleFileDoc, []admin.RuleProblem, error) {
	docs, problems := admin.ReadRuleFiles(paths)
	total := len(docs) + len(problems)
	problems = append(problems, admin.CheckRuleDocs(docs, p)...)
	if len(problems) == 0 {
		return docs, nil, nil
	}
	return docs, problems, fmt.Errorf("%d of %d rule docs invalid", len(problems), total)
}

func rulesApply(ctx context.Context, db *admin.RulesDB, cfg *config.Producer, o *rulesOpts, cio cmdIO) error {
	docs, problems, err := readAndCheck(o.args, rulesPolicy(cfg))
	if err != nil {
		if o.json {
			out := make([]map[string]string, 0, len(problems))
			for _, p := range problems {
				out = append(out, map[string]string{"action": "invalid", "file": p.File, "where": p.Where,
					"id": p.ID, "field": p.Field, "error": p.Error()})
			}
			_ = printJSON(cio.stdout, out)
		}
		for _, p := range problems {
			fmt.Fprintf(cio.stderr, "invalid: %s\n", p.Error())
		}
		return fmt.Errorf("%w: nothing was written", err)
	}
	results := []admin.ApplyResult{}
	for _, d := range docs {
		var res admin.ApplyResult
		if res, err = db.ApplyRule(ctx, d, o.dryRun); err != nil {
			break
		}
		results = append(results, res)
		if !o.json {
			fmt.Fprintln(cio.stdout, describeApply(res))
		}
	}
	if o.json {
		if perr := printJSON(cio.stdout, results); err == nil {
			err = perr
		}
	}
	return err
}

// describeApply is the line apply prints for res.
func describeApply(res admin.ApplyResult) string {
	action := res.Action
	if res.DryRun && action != admin.RuleUnchanged {
		action = "would be " + action
	}
	s := fmt.Sprintf("%-9s %s (%s)", action, res.ID, res.File)
	if res.Action == admin.RuleUpdated {
		s += ": " + strings.Join(res.Changed, ", ")
	}
	return s
}

// validateResult is one line of `validate --json`.
type validateResult struct {
	File  string `json:"file"`
	Where string `json:"where,omitempty"`
	ID    string `json:"id,omitempty"`
	Kind  string `json:"kind,omitempty"`
	Valid bool   `json:"valid"`
	Field string `json:"field,omitempty"`
	Error string `json:"error,omitempty"`
}

func rulesValidate(_ context.Context, _ *admin.RulesDB, _ *config.Producer, o *rulesOpts, cio cmdIO) error {
	docs, problems, invalid := readAndCheck(o.args, rules.Policy{SubjectPrefix: o.subjectPrefix})
	out := []validateResult{}
	for _, d := range docs {
		if d.Rule != nil {
			out = append(out, validateResult{File: d.File, ID: d.ID, Kind: d.Rule.Kind(), Valid: true})
		}
	}
	for _, p := range problems {
		out = append(out, validateResult{File: p.File, Where: p.Where, ID: p.ID, Field: p.Field, Error: p.Error()})
	}
	slices.SortStableFunc(out, func(a, b validateResult) int { // in the order of the files given
		return slices.Index(o.args, a.File) - slices.Index(o.args, b.File)
	})
	if o.json {
		if err := printJSON(cio.stdout, out); err != nil {
			return err
		}
	} else {
		for _, r := range out {
			if r.Valid {
				fmt.Fprintf(cio.stdout, "OK       %s: rule %q (%s)\n", r.File, r.ID, r.Kind)
			} else {
				fmt.Fprintf(cio.stdout, "INVALID  %s\n", r.Error)
			}
		}
	}
	return invalid
}

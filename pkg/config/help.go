package config

import (
	"bytes"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/kelseyhightower/envconfig"
)

// Var describes one environment variable of a binary.
type Var struct {
	Name, Type, Default, Description string
	Required                         bool
	// Group is the heading the variable is listed under (CouchDB, NATS, Logging, ...).
	Group string
	// Advanced marks a tuning knob: --help lists it only under --help-all.
	Advanced bool
	// Secret marks a value that is never printed or logged.
	Secret bool
	// Deprecated, when set, is the variable's new name: the old one is still read when the new
	// one is unset, with a warning at start; help leaves it out.
	Deprecated string
}

// groupOrder is the order in which help and the reference list the groups of variables.
var groupOrder = []string{"CouchDB", "NATS", "Logging", "Process", "Feed", "Jobs", "Webhooks and subjects",
	"Replication", "Install", "Admin commands"}

// HelpWidth is the longest line help prints.
const HelpWidth = 100

// Vars lists the variables of spec in declaration order.
func Vars(spec any) []Var {
	var buf bytes.Buffer
	const tmpl = `{{range .}}{{usage_key .}}` + "\x1f" + `{{usage_type .}}` + "\x1f" + `{{usage_default .}}` + "\x1f" +
		`{{usage_description .}}` + "\x1f" + `{{usage_required .}}` + "\x1f" + `{{.Tags.Get "group"}}` + "\x1f" +
		`{{.Tags.Get "advanced"}}` + "\x1f" + `{{.Tags.Get "secret"}}` + "\x1f" + `{{.Tags.Get "deprecated"}}` + "\x1e" +
		`{{end}}`
	if err := envconfig.Usagef("", spec, &buf, tmpl); err != nil {
		return nil
	}
	var out []Var
	for _, rec := range strings.Split(buf.String(), "\x1e") {
		f := strings.Split(rec, "\x1f")
		if len(f) != 9 {
			continue
		}
		out = append(out, Var{Name: f[0], Type: f[1], Default: f[2], Description: f[3], Required: f[4] == "true",
			Group: f[5], Advanced: f[6] == "true", Secret: f[7] == "true", Deprecated: f[8]})
	}
	return out
}

// byGroup returns the variables of spec in the order of groupOrder (then any other group), each
// group in declaration order.
func byGroup(spec any) []Var {
	vars := Vars(spec)
	rank := func(g string) int {
		if i := slices.Index(groupOrder, g); i >= 0 {
			return i
		}
		return len(groupOrder)
	}
	slices.SortStableFunc(vars, func(a, b Var) int { return rank(a.Group) - rank(b.Group) })
	return vars
}

// PrintHelp writes the usage of a binary: what it does, its commands, and its variables by
// group, the advanced ones left out (PrintHelpAll lists them too).
func PrintHelp(w io.Writer, usage string, spec any) { printHelp(w, usage, spec, false) }

// PrintHelpAll is PrintHelp with the advanced variables (tuning knobs) too.
func PrintHelpAll(w io.Writer, usage string, spec any) { printHelp(w, usage, spec, true) }

func printHelp(w io.Writer, usage string, spec any, all bool) {
	fmt.Fprintln(w, strings.TrimSpace(usage))
	fmt.Fprintln(w)
	hidden := 0
	for _, v := range Vars(spec) {
		if v.Advanced && !all && v.Deprecated == "" {
			hidden++
		}
	}
	fmt.Fprintln(w, "Environment:")
	PrintVars(w, spec, func(v Var) bool { return all || !v.Advanced })
	if hidden > 0 {
		fmt.Fprintf(w, "\n%d advanced variables (tuning) are left out: --help-all lists them.\n", hidden)
	}
}

// PrintVars writes the variables of spec that keep selects (deprecated names aside), under their
// group headings: the name and default on one line, then the description wrapped at HelpWidth.
func PrintVars(w io.Writer, spec any, keep func(Var) bool) {
	group := "\x00"
	for _, v := range byGroup(spec) {
		if v.Deprecated != "" || !keep(v) {
			continue
		}
		if v.Group != group {
			group = v.Group
			fmt.Fprintf(w, "  %s:\n", orOther(group))
		}
		def := v.Default
		switch {
		case v.Required:
			def = "(required)"
		case def == "":
			def = "(default: none)"
		default:
			def = "(default " + def + ")"
		}
		if v.Advanced {
			def += " [advanced]"
		}
		fmt.Fprintf(w, "    %s %s\n", v.Name, def)
		for _, l := range Wrap(v.Description, HelpWidth-8) {
			fmt.Fprintf(w, "        %s\n", l)
		}
	}
}

func orOther(group string) string {
	if group == "" {
		return "Other"
	}
	return group
}

// Wrap breaks s into lines of at most width characters at spaces (a longer word stays whole).
func Wrap(s string, width int) []string {
	var lines []string
	line := ""
	for _, word := range strings.Fields(s) {
		switch {
		case line == "":
			line = word
		case len([]rune(line))+1+len([]rune(word)) <= width:
			line += " " + word
		default:
			lines = append(lines, line)
			line = word
		}
	}
	if line != "" {
		lines = append(lines, line)
	}
	return lines
}

// Markdown renders the variables of spec as Markdown tables, one per group (a level-5 heading,
// under Reference's level-4 heading of the binary), for the README.
func Markdown(spec any) string {
	var b strings.Builder
	group := "\x00"
	for _, v := range byGroup(spec) {
		if v.Deprecated != "" {
			continue
		}
		if v.Group != group {
			if group != "\x00" {
				b.WriteString("\n")
			}
			group = v.Group
			fmt.Fprintf(&b, "##### %s\n\n| variable | default | meaning |\n| --- | --- | --- |\n", orOther(group))
		}
		def := "`" + v.Default + "`"
		if v.Required {
			def = "(required)"
		} else if v.Default == "" {
			def = "none"
		}
		desc := strings.ReplaceAll(v.Description, "|", "\\|")
		if v.Advanced {
			desc = "*advanced:* " + desc
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s |\n", v.Name, def, desc)
	}
	return b.String()
}

// Reference is the configuration reference of every binary, as Markdown.
func Reference() string {
	var b strings.Builder
	b.WriteString("#### producer (and its admin commands)\n\n")
	b.WriteString(Markdown(&Producer{}))
	b.WriteString("\n#### replicator\n\n")
	b.WriteString(Markdown(&Replicator{}))
	b.WriteString("\n#### onchange\n\n")
	b.WriteString(Markdown(&OnChange{}))
	var old []Var
	for _, spec := range []any{&Producer{}, &Replicator{}, &OnChange{}} {
		for _, v := range Vars(spec) {
			if v.Deprecated != "" && !slices.ContainsFunc(old, func(o Var) bool { return o.Name == v.Name }) {
				old = append(old, v)
			}
		}
	}
	if len(old) > 0 {
		b.WriteString("\n#### deprecated names\n\nStill read, with a warning at start; the new name wins when both are set.\n\n")
		b.WriteString("| old name | new name |\n| --- | --- |\n")
		for _, v := range old {
			fmt.Fprintf(&b, "| `%s` | `%s` |\n", v.Name, v.Deprecated)
		}
	}
	return b.String()
}

package config

import (
	"bytes"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/kelseyhightower/envconfig"
)

// Var describes one environment variable of a binary.
type Var struct {
	Name, Type, Default, Description string
	Required                         bool
}

// Vars lists the variables of spec in declaration order.
func Vars(spec any) []Var {
	var buf bytes.Buffer
	const tmpl = `{{range .}}{{usage_key .}}` + "\x1f" + `{{usage_type .}}` + "\x1f" + `{{usage_default .}}` + "\x1f" + `{{usage_description .}}` + "\x1f" + `{{usage_required .}}` + "\x1e" + `{{end}}`
	if err := envconfig.Usagef("", spec, &buf, tmpl); err != nil {
		return nil
	}
	var out []Var
	for _, rec := range strings.Split(buf.String(), "\x1e") {
		f := strings.Split(rec, "\x1f")
		if len(f) != 5 {
			continue
		}
		out = append(out, Var{Name: f[0], Type: f[1], Default: f[2], Description: f[3], Required: f[4] == "true"})
	}
	return out
}

// PrintHelp writes the usage of a binary: what it does, its commands, and its variables.
func PrintHelp(w io.Writer, usage string, spec any) {
	fmt.Fprintln(w, strings.TrimSpace(usage))
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Environment:")
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  VARIABLE\tDEFAULT\tDESCRIPTION")
	for _, v := range Vars(spec) {
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

// Markdown renders the variables of spec as a Markdown table for the README.
func Markdown(spec any) string {
	var b strings.Builder
	b.WriteString("| variable | default | meaning |\n| --- | --- | --- |\n")
	for _, v := range Vars(spec) {
		def := "`" + v.Default + "`"
		if v.Required {
			def = "(required)"
		} else if v.Default == "" {
			def = "none"
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s |\n", v.Name, def, strings.ReplaceAll(v.Description, "|", "\\|"))
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
	return b.String()
}

package config

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
)

// PrintVersion writes the build of binary name: one line ("producer v1.4.0 (commit ..., ...)
// go1.26.8"), or with asJSON an object with name and the fields of Build.
func PrintVersion(w io.Writer, name string, asJSON bool) {
	b := ReadBuild()
	if asJSON {
		_ = json.NewEncoder(w).Encode(struct {
			Name string `json:"name"`
			Build
		}{name, b})
		return
	}
	fmt.Fprintln(w, name, b)
}

// IsHelp reports whether arg asks for help (--help, -h, -help); IsHelpAll for --help-all.
func IsHelp(arg string) bool { return arg == "--help" || arg == "-h" || arg == "-help" }

// IsHelpAll reports whether arg asks for the help with the advanced variables.
func IsHelpAll(arg string) bool { return arg == "--help-all" || arg == "-help-all" }

// IsVersion reports whether arg asks for the version (--version, -version).
func IsVersion(arg string) bool { return arg == "--version" || arg == "-version" }

// UnknownArg names what is wrong with a command-line argument no command takes: "unknown flag
// --bogus" for a flag (its value left out), "unknown command frob" for a word.
func UnknownArg(arg string) string {
	if strings.HasPrefix(arg, "-") && arg != "-" {
		name, _, _ := strings.Cut(strings.TrimLeft(arg, "-"), "=")
		return "unknown flag --" + name
	}
	return "unknown command " + arg
}

// ConsumerFront handles the command line of a consumer binary (name) before its configuration is
// loaded: help (--help, -h, help; --help-all), the version (--version, version [--json]), and an
// unknown flag or command (exit 2, named). It returns done false, leaving the rest to
// consumer.Main, for no arguments (run the consumer) and for the healthcheck command.
func ConsumerFront(name, usage string, args []string, spec any, stdout, stderr io.Writer) (code int, done bool) {
	if len(args) == 0 || args[0] == "healthcheck" {
		return 0, false
	}
	switch a := args[0]; {
	case IsHelpAll(a):
		PrintHelpAll(stdout, usage, spec)
		return 0, true
	case IsHelp(a) || a == "help":
		PrintHelp(stdout, usage, spec)
		return 0, true
	case IsVersion(a) || a == "version":
		rest := args[1:]
		asJSON := len(rest) == 1 && (rest[0] == "--json" || rest[0] == "-json")
		if len(rest) > 0 && !asJSON {
			fmt.Fprintf(stderr, "%s version: %s (try %s --help)\n", name, UnknownArg(rest[0]), name)
			return 2, true
		}
		PrintVersion(stdout, name, asJSON)
		return 0, true
	default:
		fmt.Fprintf(stderr, "%s: %s (try %s --help)\n", name, UnknownArg(a), name)
		return 2, true
	}
}

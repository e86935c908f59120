package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/config"
)

// cliCommand is what the command line knows of an admin command before it runs: its help, its
// flags and the variables it reads, and how to check its arguments without any configuration.
type cliCommand struct {
	synopsis string // the arguments, e.g. "[--update] [--json]"
	about    string // what it does, in lines of at most config.HelpWidth characters
	// flags defines the command's flags on fs (for its help).
	flags func(fs *flag.FlagSet)
	// check parses args as the command will, without I/O: a bad command line is a usageError.
	check func(args []string) error
	// env names the variables the command reads beyond adminEnv.
	env []string
}

// adminEnv is what every admin command that talks to the servers reads.
const adminEnv = "SPIEGEL_COUCHDB_URL, SPIEGEL_NATS_URL and the other CouchDB and NATS variables " +
	"(SPIEGEL_COUCHDB_*, SPIEGEL_DB_NAME, SPIEGEL_NATS_*, SPIEGEL_SUBJECT_PREFIX), SPIEGEL_ADMIN_TIMEOUT and SPIEGEL_LOG_*"

// cliCommands are the admin commands' command-line descriptions (rules and healthcheck have
// their own; see rules.go and pkg/health).
var cliCommands = map[string]cliCommand{
	"install": {synopsis: "[--update] [--json]", flags: func(fs *flag.FlagSet) { installFlags(fs) },
		check: func(a []string) error { _, err := parseInstall(a); return err }, about: installHelp,
		env: []string{"SPIEGEL_CHANGES_MAX_AGE", "SPIEGEL_DEADLETTER_MAX_AGE", "SPIEGEL_MAX_ACK_PENDING",
			"SPIEGEL_STREAM_REPLICAS", "SPIEGEL_ACK_WAIT"}},
	"uninstall": {synopsis: "[--yes] [--keep-db] [--json]", flags: func(fs *flag.FlagSet) { uninstallFlags(fs) },
		check: func(a []string) error { _, err := parseUninstall(a); return err }, about: uninstallHelp},
	"resync": {synopsis: "[--db REGEX] [--json]", flags: func(fs *flag.FlagSet) { resyncFlags(fs) },
		check: func(a []string) error { _, err := parseResync(a); return err }, about: resyncHelp},
	"replay": {synopsis: "--rule ID [--db REGEX] [--since SEQ] [--id ID] [--wait DURATION] [--json]",
		flags: func(fs *flag.FlagSet) { replayFlags(fs) },
		check: func(a []string) error { _, err := parseReplay(a); return err }, about: replayHelp},
	"status": {synopsis: "[--rule ID] [--json] [--check]", flags: func(fs *flag.FlagSet) { statusFlags(fs) },
		check: func(a []string) error { _, err := parseStatus(a); return err }, about: statusHelp},
	"deadletters": {synopsis: "list|retry|purge [--group G] [--rule ID] [--db REGEX] [--since AGE]\n" +
		"      [--before ID] [--limit N] [--json] [--yes]", flags: func(fs *flag.FlagSet) { deadLetterFlags(fs, "list") },
		check: func(a []string) error { _, err := parseDeadLetters(a); return err }, about: deadLettersHelp},
}

// parseFlags parses args with fs and names what is wrong in the words of the other CLIs
// ("unknown flag --bogus"), as a usageError. Unless positional is true, arguments that are not
// flags are refused.
func parseFlags(fs *flag.FlagSet, args []string, positional bool) error {
	fs.SetOutput(io.Discard) // the error names the flag; --help prints the flags
	fs.Usage = func() {}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{flagError(err)}
	}
	if !positional && fs.NArg() > 0 {
		return usageError{fmt.Errorf("unexpected arguments %q", fs.Args())}
	}
	return nil
}

// flagError rewords the flag package's errors: "flag provided but not defined: -bogus" is
// "unknown flag --bogus", "flag needs an argument: -db" is "flag --db needs a value".
func flagError(err error) error {
	msg := err.Error()
	if name, ok := strings.CutPrefix(msg, "flag provided but not defined: "); ok {
		return errors.New(config.UnknownArg(name))
	}
	if name, ok := strings.CutPrefix(msg, "flag needs an argument: "); ok {
		return fmt.Errorf("flag --%s needs a value", strings.TrimLeft(name, "-"))
	}
	if rest, ok := strings.CutPrefix(msg, "invalid value "); ok {
		return errors.New("invalid value " + strings.Replace(rest, " for flag -", " for flag --", 1))
	}
	if rest, ok := strings.CutPrefix(msg, "invalid boolean value "); ok {
		return errors.New("invalid boolean value " + strings.Replace(rest, " for -", " for --", 1))
	}
	return err
}

// checkArgs checks the command line of cmd before the configuration is loaded, so that a bad
// one exits 2 naming the problem whatever the environment holds.
func checkArgs(cmd string, args []string) error {
	if cmd == "" {
		if len(args) > 0 {
			return usageError{errors.New(config.UnknownArg(args[0]))}
		}
		return nil
	}
	if c, ok := cliCommands[cmd]; ok {
		return c.check(args)
	}
	return nil
}

// printCommandHelp prints the help of the admin command cmd: what it does, its flags with their
// defaults, the variables it reads, and (all) every variable of the producer.
func printCommandHelp(w io.Writer, cmd string, c cliCommand, all bool) {
	fmt.Fprintf(w, "producer %s %s\n\n%s\n\nFlags:\n", cmd, c.synopsis, strings.TrimSpace(c.about))
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	c.flags(fs)
	fs.VisitAll(func(f *flag.Flag) { printFlag(w, f) })
	printFlagLine(w, "--timeout DURATION (default 15s, SPIEGEL_ADMIN_TIMEOUT)",
		"how long to wait for CouchDB and NATS before giving up")
	printFlagLine(w, "--help, --help-all", "this help; with every variable of the producer")
	reads := "Reads " + adminEnv
	if len(c.env) > 0 {
		reads += "; and " + strings.Join(c.env, ", ")
	}
	fmt.Fprintln(w)
	for _, l := range config.Wrap(reads+". `producer --help` describes them.", config.HelpWidth) {
		fmt.Fprintln(w, l)
	}
	if all {
		fmt.Fprintln(w, "\nEnvironment:")
		config.PrintVars(w, &config.Producer{}, func(config.Var) bool { return true })
	}
}

// printFlag prints one flag as Go's flag package does, with two dashes: the name, the value's
// name (a `quoted` word of the usage) and the default, then the usage wrapped.
func printFlag(w io.Writer, f *flag.Flag) {
	value, usage := flag.UnquoteUsage(f)
	head := "--" + f.Name
	if value != "" {
		head += " " + strings.ToUpper(value)
	}
	if f.DefValue != "" && f.DefValue != "false" && f.DefValue != "0" {
		head += " (default " + f.DefValue + ")"
	}
	printFlagLine(w, head, usage)
}

func printFlagLine(w io.Writer, head, usage string) {
	fmt.Fprintf(w, "  %s\n", head)
	for _, l := range config.Wrap(usage, config.HelpWidth-8) {
		fmt.Fprintf(w, "        %s\n", l)
	}
}

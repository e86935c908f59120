package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/config"
	"github.com/spiegel-nats/spiegel/pkg/logging"
)

const installHelp = `Create what Spiegel needs and is missing (idempotent; safe to run twice or concurrently): the
spiegel db with admin-only security and a validate_doc_update that rejects invalid rule docs,
_global_changes on CouchDB 2/3 when missing, the JetStream streams (work, wakeups, dead letters,
changes), the key-value buckets and the durable consumers "replicator" and "onchange". What
exists is left as it is: install prints each setting in which an existing stream, bucket or
consumer differs from what it would create (e.g. a max_age set with nats stream edit), and keeps
it. --update applies those differences (UpdateStream, UpdateConsumer) and prints each one
changed; what JetStream cannot change in place (storage, a work queue's retention, a consumer's
ack or deliver policy) is reported and kept.`

const uninstallHelp = `Delete the streams and consumers, the on_change checkpoints and the spiegel db (rules and
checkpoints). Asks for confirmation on the terminal unless --yes. --keep-db keeps the spiegel db
and its rules.`

type installOpts struct{ update, json bool }

func installFlags(fs *flag.FlagSet) *installOpts {
	o := &installOpts{}
	fs.BoolVar(&o.update, "update", false, "apply install's settings to the existing streams, buckets and consumers")
	fs.BoolVar(&o.json, "json", false, "print the steps as JSON")
	return o
}

func parseInstall(args []string) (*installOpts, error) {
	fs := flag.NewFlagSet("install", flag.ContinueOnError)
	o := installFlags(fs)
	return o, parseFlags(fs, args, false)
}

// runInstall creates what Spiegel needs and is missing, and reports how the existing streams,
// buckets and consumers differ from install's settings; --update applies those differences
// (admin.Install).
func runInstall(ctx context.Context, cfg *config.Producer, log *logrus.Logger, cio cmdIO) error {
	o, err := parseInstall(cio.args)
	if err != nil {
		return err
	}
	d, err := admin.Connect(ctx, cfg, log, 256)
	if err != nil {
		return err
	}
	defer d.NC.Close()
	if !o.json {
		return admin.Install(ctx, d, o.update, cio.stdout)
	}
	var out bytes.Buffer
	err = admin.Install(ctx, d, o.update, &out)
	return printSteps(cio.stdout, out.String(), "install complete", err)
}

type uninstallOpts struct{ yes, keepDB, json bool }

func uninstallFlags(fs *flag.FlagSet) *uninstallOpts {
	o := &uninstallOpts{}
	fs.BoolVar(&o.yes, "yes", false, "do not ask for confirmation")
	fs.BoolVar(&o.keepDB, "keep-db", false, "keep the spiegel db and its rules")
	fs.BoolVar(&o.json, "json", false, "print the steps as JSON")
	return o
}

func parseUninstall(args []string) (*uninstallOpts, error) {
	fs := flag.NewFlagSet("uninstall", flag.ContinueOnError)
	o := uninstallFlags(fs)
	return o, parseFlags(fs, args, false)
}

// runUninstall removes the streams and consumers, and the spiegel db unless --keep-db.
func runUninstall(ctx context.Context, cfg *config.Producer, log *logrus.Logger, cio cmdIO) error {
	o, err := parseUninstall(cio.args)
	if err != nil {
		return err
	}
	what := fmt.Sprintf("the NATS streams %s_* and their consumers", strings.ToUpper(cfg.SubjectPrefix))
	if !o.keepDB {
		what += fmt.Sprintf(", and the spiegel db %q with every rule and checkpoint", cfg.DBName)
	}
	if !o.yes && !confirm(cio, "This deletes "+what+".") {
		return usageError{errors.New("not confirmed; nothing was deleted (use --yes to skip the question)")}
	}
	d, err := admin.Connect(ctx, cfg, log, 256)
	if err != nil {
		return err
	}
	defer d.NC.Close()
	if !o.json {
		return admin.Uninstall(ctx, d, log, o.keepDB, cio.stdout)
	}
	var out bytes.Buffer
	err = admin.Uninstall(ctx, d, log, o.keepDB, &out)
	return printSteps(cio.stdout, out.String(), "", err)
}

// step is one line of install's or uninstall's report: what, and what became of it.
type step struct {
	Object string `json:"object,omitempty"`
	Result string `json:"result"`
}

// stepsReport is the --json form of install's and uninstall's report.
type stepsReport struct {
	Steps []step `json:"steps"`
	Done  bool   `json:"done"`
	Error string `json:"error,omitempty"`
}

// printSteps prints the report text (one step per line, "object: result") as JSON: done when
// err is nil (and, if doneLine is not "", the report ends with it). It returns err.
func printSteps(w io.Writer, text, doneLine string, err error) error {
	rep := stepsReport{Steps: []step{}, Done: err == nil}
	for _, l := range strings.Split(strings.TrimSpace(text), "\n") {
		switch object, result, ok := strings.Cut(l, ": "); {
		case l == "":
		case l == doneLine:
			rep.Done = err == nil
		case ok:
			rep.Steps = append(rep.Steps, step{Object: object, Result: result})
		default:
			rep.Steps = append(rep.Steps, step{Result: l})
		}
	}
	if doneLine != "" && !strings.Contains(text, doneLine) {
		rep.Done = false
	}
	if err != nil {
		rep.Error = logging.RedactText(err.Error())
	}
	if perr := printJSON(w, rep); err == nil {
		return perr
	}
	return err
}

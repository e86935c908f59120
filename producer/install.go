package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"

	"github.com/sirupsen/logrus"

	"github.com/spiegel-nats/spiegel/pkg/admin"
	"github.com/spiegel-nats/spiegel/pkg/config"
)

// runInstall creates what Spiegel needs and is missing, and reports how the existing streams,
// buckets and consumers differ from install's settings; --update applies those differences
// (admin.Install).
func runInstall(ctx context.Context, cfg *config.Producer, log *logrus.Logger, cio cmdIO) error {
	fs := flag.NewFlagSet("install", flag.ContinueOnError)
	fs.SetOutput(cio.stderr)
	update := fs.Bool("update", false, "apply install's settings to the existing streams, buckets and consumers")
	if err := fs.Parse(cio.args); err != nil {
		return usageError{err}
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Errorf("unexpected arguments %q", fs.Args())}
	}
	d, err := admin.Connect(ctx, cfg, log, 256)
	if err != nil {
		return err
	}
	defer d.NC.Close()
	return admin.Install(ctx, d, *update, cio.stdout)
}

// runUninstall removes the streams and consumers, and the spiegel db unless --keep-db.
func runUninstall(ctx context.Context, cfg *config.Producer, log *logrus.Logger, cio cmdIO) error {
	fs := flag.NewFlagSet("uninstall", flag.ContinueOnError)
	fs.SetOutput(cio.stderr)
	yes := fs.Bool("yes", false, "do not ask for confirmation")
	keep := fs.Bool("keep-db", false, "keep the spiegel db and its rules")
	if err := fs.Parse(cio.args); err != nil {
		return usageError{err}
	}
	what := fmt.Sprintf("the NATS streams %s_* and their consumers", strings.ToUpper(cfg.SubjectPrefix))
	if !*keep {
		what += fmt.Sprintf(", and the spiegel db %q with every rule and checkpoint", cfg.DBName)
	}
	if !*yes && !confirm(cio, "This deletes "+what+".") {
		return usageError{errors.New("not confirmed; nothing was deleted (use --yes to skip the question)")}
	}
	d, err := admin.Connect(ctx, cfg, log, 256)
	if err != nil {
		return err
	}
	defer d.NC.Close()
	return admin.Uninstall(ctx, d, log, *keep, cio.stdout)
}

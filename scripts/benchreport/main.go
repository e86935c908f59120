// Command benchreport writes the end-to-end benchmark report (make bench-e2e): it reads the runs
// the workload benchmark recorded (scripts/e2e, BenchmarkWorkload with BENCH_REPORT_DIR; one
// file per setup and number of dbs; BenchmarkScaling's runs, one per group and number of
// processes) and writes report.md with its charts as PNG and SVG.
//
//	benchreport -in DIR_OF_RUNS -out REPORT_DIR [-load-start "1.00 0.50 0.20"]
//	benchreport -scale-in SCALE.json -out REPORT_DIR   (the scale simulation, make bench-scale)
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

func main() {
	in := flag.String("in", "", "directory of the recorded runs (workload-<setup>-<dbs>.json)")
	out := flag.String("out", "", "directory to write report.md and the charts into")
	loadStart := flag.String("load-start", "", "/proc/loadavg when the bench started (first three fields)")
	scaleIn := flag.String("scale-in", "", "the scale simulation's figures (BenchmarkScale's SPIEGEL_SCALE_REPORT): write scale.md and its charts into -out instead (scale.go)")
	flag.Parse()
	if *scaleIn != "" && *out != "" {
		if err := runScale(*scaleIn, *out); err != nil {
			fmt.Fprintln(os.Stderr, "benchreport:", err)
			os.Exit(1)
		}
		return
	}
	if *in == "" || *out == "" {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(*in, *out, *loadStart); err != nil {
		fmt.Fprintln(os.Stderr, "benchreport:", err)
		os.Exit(1)
	}
}

func run(in, out, loadStart string) error {
	runs, err := readRuns(in)
	if err != nil {
		return err
	}
	scaling, err := readScalingRuns(in)
	if err != nil {
		return err
	}
	if len(runs) == 0 && len(scaling) == 0 {
		return fmt.Errorf("no runs in %s", in)
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return fmt.Errorf("create %s: %w", out, err)
	}
	loadEnd := ""
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		f := strings.Fields(string(b))
		loadEnd = strings.Join(f[:min(3, len(f))], " ")
	}
	m := machine{loadStart: loadStart, loadEnd: loadEnd}
	md := scalingOnlyHeader(scaling, m)
	if len(runs) > 0 {
		if md, err = render(runs, out, m); err != nil {
			return err
		}
	}
	if len(scaling) > 0 {
		section, err := scalingSection(scaling, out)
		if err != nil {
			return err
		}
		md += section
	}
	path := filepath.Join(out, "report.md")
	if err := os.WriteFile(path, []byte(md), 0o644); err != nil {
		return fmt.Errorf("write report: %w", err)
	}
	fmt.Println(path)
	return nil
}

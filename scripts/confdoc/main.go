// Command confdoc writes the references generated from the code into the pages that hold them,
// each between its markers: the configuration of every binary (pkg/config/README.md, from
// pkg/config's structs) and every metric (deployments/README.md, from the collectors of
// pkg/metrics and pkg/health). Its test fails while a committed page differs from what it
// generates. Run it from the repository root after changing a variable or a metric:
//
//	go run ./scripts/confdoc          # rewrite the pages
//	go run ./scripts/confdoc -check   # exit 1 naming each stale page, write nothing
//	go run ./scripts/confdoc -print   # print the references, write nothing
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	root := flag.String("root", ".", "the repository root")
	check := flag.Bool("check", false, "write nothing; exit 1 when a page is stale")
	print := flag.Bool("print", false, "print the references; write nothing")
	flag.Parse()
	if *print {
		secs, err := sections()
		if err != nil {
			fmt.Fprintln(os.Stderr, "confdoc:", err)
			os.Exit(1)
		}
		for _, s := range secs {
			fmt.Printf("%s (%s)\n\n%s\n", s.name, s.file, s.text)
		}
		return
	}
	if err := run(*root, *check); err != nil {
		fmt.Fprintln(os.Stderr, "confdoc:", err)
		os.Exit(1)
	}
}

func run(root string, check bool) error {
	secs, err := sections()
	if err != nil {
		return err
	}
	stale := 0
	for _, s := range secs {
		changed, err := s.apply(root, !check)
		if err != nil {
			return err
		}
		if changed {
			stale++
			if check {
				fmt.Printf("%s: %s reference is stale\n", s.file, s.name)
			} else {
				fmt.Printf("%s: %s reference rewritten\n", s.file, s.name)
			}
		}
	}
	if check && stale > 0 {
		return fmt.Errorf("%d stale reference(s): run go run ./scripts/confdoc", stale)
	}
	return nil
}

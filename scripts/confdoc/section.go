package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/spiegel-nats/spiegel/pkg/config"
)

// section is a generated part of a Markdown page: the text between
// "<!-- NAME:begin -->" and "<!-- NAME:end -->" in file (relative to the repository root).
type section struct {
	file, name string
	text       string
}

// sections returns every generated reference with its text as the code gives it now.
func sections() ([]section, error) {
	m, err := metricsReference()
	if err != nil {
		return nil, err
	}
	return []section{
		{file: "pkg/config/README.md", name: "config", text: configReference()},
		{file: "deployments/README.md", name: "metrics", text: m},
	}, nil
}

// configReference is pkg/config's table of every binary's variables, one section per binary.
func configReference() string {
	return strings.ReplaceAll(config.Reference(), "#### ", "## ")
}

func (s section) markers() (begin, end string) {
	return "<!-- " + s.name + ":begin -->\n", "<!-- " + s.name + ":end -->"
}

// committed returns the text between the section's markers in its file under root.
func (s section) committed(root string) (page, text string, err error) {
	b, err := os.ReadFile(filepath.Join(root, s.file))
	if err != nil {
		return "", "", fmt.Errorf("read %s: %w", s.file, err)
	}
	page = string(b)
	begin, end := s.markers()
	i := strings.Index(page, begin)
	j := strings.Index(page, end)
	if i < 0 || j < i {
		return "", "", fmt.Errorf("%s lacks the markers %q and %q", s.file, strings.TrimSpace(begin), end)
	}
	return page, page[i+len(begin) : j], nil
}

// apply reports whether the committed text differs from the generated one and, when write is
// set, replaces it.
func (s section) apply(root string, write bool) (bool, error) {
	page, old, err := s.committed(root)
	if err != nil {
		return false, err
	}
	if old == s.text {
		return false, nil
	}
	if !write {
		return true, nil
	}
	begin, _ := s.markers()
	i := strings.Index(page, begin) + len(begin)
	page = page[:i] + s.text + page[i+len(old):]
	if err := os.WriteFile(filepath.Join(root, s.file), []byte(page), 0o644); err != nil {
		return false, fmt.Errorf("write %s: %w", s.file, err)
	}
	return true, nil
}

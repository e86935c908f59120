// Command confdoc prints the configuration reference of every binary as Markdown, the text the
// README's "Configuration reference" section holds (pkg/config's tests fail when they differ).
package main

import (
	"fmt"

	"github.com/spiegel-nats/spiegel/pkg/config"
)

func main() { fmt.Print(config.Reference()) }

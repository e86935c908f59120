// Package freeport picks loopback ports for listeners that a test or a harness must name before
// they start (a NATS cluster's routes, a process's health address, a server restarted on its
// port).
//
// A port found by listening on port 0 and closing the listener is in the kernel's ephemeral
// range, where the kernel hands out ports for every other listen on port 0 and for the local
// end of every outgoing connection: one may take it before its listener starts (a NATS node of
// a test cluster could not bind its route port so). Ports picks them below that range instead,
// where the kernel never chooses on its own.
package freeport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
)

// low is the first port Ports picks from; the range ends below the ephemeral range.
const low = 10000

var (
	mu    sync.Mutex
	given = map[int]bool{} // ports this process handed out already
)

// Ports returns n distinct loopback ports that were free a moment ago, below the ephemeral
// range. A port is never handed out twice by one process.
func Ports(n int) ([]int, error) {
	high := ephemeralLow()
	mu.Lock()
	defer mu.Unlock()
	var out []int
	for tries := 0; len(out) < n; tries++ {
		if tries > 100*n+1000 {
			return nil, fmt.Errorf("freeport: no free port in %d-%d after %d tries", low, high-1, tries)
		}
		p := low + rand.IntN(high-low)
		if given[p] {
			continue
		}
		ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			continue
		}
		_ = ln.Close()
		given[p] = true
		out = append(out, p)
	}
	return out, nil
}

// Addr returns a loopback address with a port from Ports.
func Addr() (string, error) {
	p, err := Ports(1)
	if err != nil {
		return "", err
	}
	return "127.0.0.1:" + strconv.Itoa(p[0]), nil
}

// ephemeralLow is the first port of the kernel's ephemeral range (Linux's
// ip_local_port_range; 32768 where it cannot be read, below macOS' 49152 too).
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 32768
	}
	v, err := strconv.Atoi(f[0])
	if err != nil || v <= low+1000 {
		return 32768
	}
	return v
}

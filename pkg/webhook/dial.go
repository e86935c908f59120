package webhook

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// ErrAddressNotAllowed means a connection was refused before it was made because the address
// it would have gone to is not allowed: a loopback, private, link-local, CGNAT or otherwise
// non-public address of a host the allow-list does not name, or, with an allow-list, an address
// in none of its ranges. Retrying cannot help.
var ErrAddressNotAllowed = errors.New("webhook: address not allowed")

// dialTimeout bounds the connection to one address (the request's own timeout bounds the whole).
const dialTimeout = 10 * time.Second

// Resolver resolves host names (*net.Resolver; tests pass their own).
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

// allowList is SPIEGEL_WEBHOOK_ALLOWED_HOSTS parsed. Entries are host names ("api.example"),
// host names with a port ("api.example:8443"), subdomain wildcards ("*.example"), IP literals
// ("127.0.0.1", "::1" or "[::1]:8080"), all matched against the URL's host as written, and CIDR
// ranges ("10.0.0.0/8"), matched against the address dialled.
type allowList struct {
	names []string // lower case; IP literals in netip's canonical form
	nets  []netip.Prefix
}

func parseAllowList(entries []string) allowList {
	var a allowList
	for _, e := range entries {
		e = strings.ToLower(strings.TrimSpace(e))
		switch {
		case e == "":
		case strings.Contains(e, "/"):
			if p, err := netip.ParsePrefix(e); err == nil {
				a.nets = append(a.nets, p.Masked())
			} // config.OnChange.Validate refuses a range that does not parse
		default:
			a.names = append(a.names, canonicalHost(e))
		}
	}
	return a
}

// canonicalHost writes IP literals (bare or with a port) in one form, so that "::1", "[::1]" and
// "0:0::1" are the same entry.
func canonicalHost(h string) string {
	if ap, err := netip.ParseAddrPort(h); err == nil {
		return ap.String()
	}
	if ip, err := netip.ParseAddr(strings.Trim(h, "[]")); err == nil {
		return ip.String()
	}
	return h
}

// set reports whether the list has any entry: then only what it allows is called.
func (a allowList) set() bool { return len(a.names) > 0 || len(a.nets) > 0 }

// names reports whether the list names host (the URL's hostname) on port (its port, explicit
// or the scheme's): by name, by name and port, or by a wildcard.
func (a allowList) named(host, port string) bool {
	host = canonicalHost(strings.ToLower(host))
	hostPort := net.JoinHostPort(host, port)
	if ip, err := netip.ParseAddr(host); err == nil {
		hostPort = netip.AddrPortFrom(ip, parsePort(port)).String()
	}
	for _, n := range a.names {
		switch {
		case n == host || n == hostPort:
			return true
		case strings.HasPrefix(n, "*.") && strings.HasSuffix(host, n[1:]):
			return true
		}
	}
	return false
}

// parsePort is p as a port number, 0 when it is not one.
func parsePort(p string) uint16 {
	n, err := strconv.ParseUint(p, 10, 16)
	if err != nil {
		return 0
	}
	return uint16(n)
}

// urlPort is u's port, or its scheme's default.
func urlPort(u *url.URL) string {
	if p := u.Port(); p != "" {
		return p
	}
	if u.Scheme == "https" {
		return "443"
	}
	return "80"
}

// mayCall reports whether a request to u may be attempted at all: always without a list; with
// one, when it names u's host or has ranges (the address dialled then decides).
func (a allowList) mayCall(u *url.URL) bool {
	return !a.set() || len(a.nets) > 0 || a.named(u.Hostname(), urlPort(u))
}

// addressPolicy decides, for one host, which addresses a connection may go to.
type addressPolicy struct {
	host   string
	any    bool           // the allow-list names the host: every address it resolves to
	nets   []netip.Prefix // with an allow-list that does not name the host: only these
	strict bool           // with an allow-list: nothing outside nets
}

func (a allowList) policyFor(host, port string) addressPolicy {
	if a.named(host, port) {
		return addressPolicy{host: host, any: true}
	}
	return addressPolicy{host: host, nets: a.nets, strict: a.set()}
}

// check returns nil when the policy allows a connection to ip, else an *addressError.
func (p addressPolicy) check(ip netip.Addr) error {
	if p.any {
		return nil
	}
	ip = ip.Unmap()
	for _, n := range p.nets {
		if n.Contains(ip) {
			return nil
		}
	}
	if p.strict {
		return &addressError{host: p.host, reason: "it is not named in SPIEGEL_WEBHOOK_ALLOWED_HOSTS and the address dialled is in none of its ranges"}
	}
	if why := nonPublic(ip); why != "" {
		return &addressError{host: p.host, reason: "the address dialled is " + why + "; name the host or its range in SPIEGEL_WEBHOOK_ALLOWED_HOSTS to allow it"}
	}
	return nil
}

// addressError is a refused connection. Its text names the host and the kind of address, never
// the address itself (a rule author must not learn the internal network from errors).
type addressError struct{ host, reason string }

func (e *addressError) Error() string {
	return fmt.Sprintf("host %q refused: %s", e.host, e.reason)
}

func (e *addressError) Is(target error) bool { return target == ErrAddressNotAllowed }

// control is the net.Dialer hook: it runs on the address the socket is about to connect to,
// after every name resolution, so a name that resolves differently later is still caught.
func (p addressPolicy) control(_, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return &addressError{host: p.host, reason: "the address dialled does not parse"}
	}
	return p.check(ap.Addr())
}

// dialer makes the connections of webhook requests: it resolves the host itself (with the
// injected Resolver) and connects to each address in turn through a net.Dialer whose Control
// hook enforces the host's addressPolicy on the socket address.
type dialer struct {
	allow    allowList
	resolver Resolver
}

// DialContext is http.Transport.DialContext.
func (d *dialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	policy := d.allow.policyFor(host, port)
	var ips []netip.Addr
	if ip, err := netip.ParseAddr(host); err == nil {
		ips = []netip.Addr{ip}
	} else if ips, err = d.resolver.LookupNetIP(ctx, "ip", host); err != nil {
		return nil, err
	}
	if len(ips) == 0 {
		return nil, fmt.Errorf("host %q has no address", host)
	}
	var refused, failed error
	for _, ip := range ips {
		ip = ip.Unmap() // resolvers may answer IPv4 in its mapped form, which an IPv4-only host cannot dial
		nd := net.Dialer{Timeout: dialTimeout, KeepAlive: 30 * time.Second, Control: policy.control}
		conn, err := nd.DialContext(ctx, network, netip.AddrPortFrom(ip, parsePort(port)).String())
		if err == nil {
			return conn, nil
		}
		if errors.Is(err, ErrAddressNotAllowed) {
			refused = err
			continue
		}
		failed = err
		if ctx.Err() != nil {
			break
		}
	}
	if failed != nil {
		return nil, failed
	}
	return nil, refused
}

// special lists the address ranges that are not public (IANA special-purpose registries). The
// IPv6 space outside 2000::/3 is refused as a whole below.
var special = []struct {
	prefix netip.Prefix
	what   string
}{
	{netip.MustParsePrefix("0.0.0.0/8"), `an unspecified ("this network") address`},
	{netip.MustParsePrefix("10.0.0.0/8"), "a private address"},
	{netip.MustParsePrefix("100.64.0.0/10"), "a shared (CGNAT) address"},
	{netip.MustParsePrefix("127.0.0.0/8"), "a loopback address"},
	{netip.MustParsePrefix("169.254.0.0/16"), "a link-local address"},
	{netip.MustParsePrefix("172.16.0.0/12"), "a private address"},
	{netip.MustParsePrefix("192.0.0.0/24"), "an IETF protocol assignment address"},
	{netip.MustParsePrefix("192.0.2.0/24"), "a documentation address"},
	{netip.MustParsePrefix("192.88.99.0/24"), "a 6to4 relay address"},
	{netip.MustParsePrefix("192.168.0.0/16"), "a private address"},
	{netip.MustParsePrefix("198.18.0.0/15"), "a benchmarking address"},
	{netip.MustParsePrefix("198.51.100.0/24"), "a documentation address"},
	{netip.MustParsePrefix("203.0.113.0/24"), "a documentation address"},
	{netip.MustParsePrefix("224.0.0.0/4"), "a multicast address"},
	{netip.MustParsePrefix("240.0.0.0/4"), "a reserved or broadcast address"},
	{netip.MustParsePrefix("::/128"), "an unspecified address"},
	{netip.MustParsePrefix("::1/128"), "a loopback address"},
	{netip.MustParsePrefix("fe80::/10"), "a link-local address"},
	{netip.MustParsePrefix("fc00::/7"), "a private (unique local) address"},
	{netip.MustParsePrefix("ff00::/8"), "a multicast address"},
	{netip.MustParsePrefix("64:ff9b:1::/48"), "a local NAT64 address"},
	{netip.MustParsePrefix("2001::/32"), "a Teredo address"},
	{netip.MustParsePrefix("2001:2::/48"), "a benchmarking address"},
	{netip.MustParsePrefix("2001:10::/28"), "an ORCHID address"},
	{netip.MustParsePrefix("2001:20::/28"), "an ORCHID address"},
	{netip.MustParsePrefix("2001:db8::/32"), "a documentation address"},
}

var (
	globalV6  = netip.MustParsePrefix("2000::/3")
	nat64     = netip.MustParsePrefix("64:ff9b::/96")
	sixToFour = netip.MustParsePrefix("2002::/16")
)

// nonPublic describes ip when it is not a public unicast address ("a loopback address", ...),
// else returns "". IPv4-mapped IPv6 addresses are judged as the IPv4 address they carry, NAT64
// (64:ff9b::/96) and 6to4 (2002::/16) addresses by the IPv4 address they embed.
func nonPublic(ip netip.Addr) string {
	ip = ip.Unmap().WithZone("")
	for _, s := range special {
		if s.prefix.Contains(ip) {
			return s.what
		}
	}
	if ip.Is4() {
		return ""
	}
	b := ip.As16()
	switch {
	case nat64.Contains(ip):
		if why := nonPublic(netip.AddrFrom4([4]byte(b[12:16]))); why != "" {
			return "a NAT64 address of " + why
		}
		return ""
	case sixToFour.Contains(ip):
		if why := nonPublic(netip.AddrFrom4([4]byte(b[2:6]))); why != "" {
			return "a 6to4 address of " + why
		}
		return ""
	case !globalV6.Contains(ip):
		return "not a global unicast address"
	}
	return ""
}

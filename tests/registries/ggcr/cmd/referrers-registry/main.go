// Command referrers-registry serves go-containerregistry's registry (pkg/registry, in memory)
// with the OCI referrers API on, for cachectl's tests: Debian's docker-registry (distribution
// 2.8) has no referrers API, so the client's API path is tested against this one.
//
//	referrers-registry [-addr 127.0.0.1:0] [-log FILE] [-referrers=false] [-referrers-page N [-referrers-link-base URL]] [-oci-subject]
//
// With -referrers-page N the referrers API answers in pages of N, newest push first, each with a
// Link header to the next (paged.go), as OCI distribution 1.1 lets a registry paginate them;
// -referrers-link-base makes those links name another origin (a client must not follow them
// there, with or without its login). -oci-subject answers a pushed manifest that has a subject
// with the OCI-Subject header, as OCI distribution 1.1 asks (the registry package sends none).
//
// -referrers=false answers the API's path 404, as a registry without it; this registry keeps a
// manifest's bytes as pushed, whatever they are.
//
// It prints "listening on HOST:PORT" once it accepts connections (port 0: a free one) and
// serves until killed. Plain HTTP, no login: for loopback only.
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"

	"github.com/google/go-containerregistry/pkg/registry"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "address to listen on (port 0: a free one)")
	logFile := flag.String("log", "", "file for the request log (default: none)")
	page := flag.Int("referrers-page", 0, "referrers listed per page, newest first (default 0: all in one)")
	referrers := flag.Bool("referrers", true, "serve the referrers API (false: 404, as a registry without it)")
	subject := flag.Bool("oci-subject", false, "answer a pushed manifest that has a subject with its OCI-Subject header")
	linkBase := flag.String("referrers-link-base", "", "with -referrers-page: an origin (http://HOST:PORT) each next-page link names, instead of a relative link")
	flag.Parse()
	var out io.Writer = io.Discard
	if *logFile != "" {
		f, err := os.OpenFile(*logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			fmt.Fprintln(os.Stderr, "referrers-registry:", err)
			os.Exit(2)
		}
		out = f
	}
	l, err := net.Listen("tcp", *addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "referrers-registry:", err)
		os.Exit(2)
	}
	var handler http.Handler = registry.New(
		registry.WithReferrersSupport(*referrers),
		registry.Logger(log.New(out, "", log.LstdFlags)),
	)
	if *page > 0 || *subject {
		handler = newPaged(handler, *page, *linkBase, *subject)
	}
	fmt.Printf("listening on %s\n", l.Addr())
	os.Stdout.Sync()
	if err := http.Serve(l, handler); err != nil {
		fmt.Fprintln(os.Stderr, "referrers-registry:", err)
		os.Exit(1)
	}
}

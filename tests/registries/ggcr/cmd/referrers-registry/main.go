// Command referrers-registry serves go-containerregistry's registry (pkg/registry, in memory)
// with the OCI referrers API on, for cachectl's tests: Debian's docker-registry (distribution
// 2.8) has no referrers API, so the client's API path is tested against this one.
//
//	referrers-registry [-addr 127.0.0.1:0] [-log FILE]
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
	handler := registry.New(
		registry.WithReferrersSupport(true),
		registry.Logger(log.New(out, "", log.LstdFlags)),
	)
	fmt.Printf("listening on %s\n", l.Addr())
	os.Stdout.Sync()
	if err := http.Serve(l, handler); err != nil {
		fmt.Fprintln(os.Stderr, "referrers-registry:", err)
		os.Exit(1)
	}
}

package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sort"
	"strconv"
	"strings"
	"sync"
)

// paged serves the referrers API's listings in pages of n (when n > 0), newest push first, each page but the
// last with a `Link: <...>; rel="next"` header to the next: OCI distribution 1.1 lets a
// registry paginate them so, and the registry package lists every referrer in one answer, in
// Go's map order. The order is the pushes' (seen here, by each manifest's digest), so a test
// knows which page holds what. With subject, a manifest push that has a subject is answered with
// OCI-Subject. Every other request goes to the registry as it came.
type paged struct {
	inner   http.Handler
	n       int    // referrers a page; 0: the registry's one answer
	base    string // put before each Link's path: "" (a relative link) or another origin's URL
	subject bool   // answer a pushed manifest that has a subject with its OCI-Subject header

	mu     sync.Mutex
	pushed map[string]int // manifest digest -> its push's place in the order
}

func newPaged(inner http.Handler, n int, base string, subject bool) *paged {
	return &paged{inner: inner, n: n, base: base, subject: subject, pushed: map[string]int{}}
}

func (p *paged) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.Method == http.MethodPut && strings.Contains(r.URL.Path, "/manifests/"):
		p.recordPush(w, r)
	case p.n > 0 && r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/referrers/"):
		p.servePage(w, r)
	default:
		p.inner.ServeHTTP(w, r)
	}
}

func (p *paged) recordPush(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	sum := sha256.Sum256(body)
	digest := "sha256:" + hex.EncodeToString(sum[:])
	p.mu.Lock()
	if _, seen := p.pushed[digest]; !seen {
		p.pushed[digest] = len(p.pushed)
	}
	p.mu.Unlock()
	r.Body = io.NopCloser(bytes.NewReader(body))
	var manifest struct {
		Subject *struct {
			Digest string `json:"digest"`
		} `json:"subject"`
	}
	if p.subject && json.Unmarshal(body, &manifest) == nil && manifest.Subject != nil {
		w = &withSubject{ResponseWriter: w, digest: manifest.Subject.Digest}
	}
	p.inner.ServeHTTP(w, r)
}

// withSubject adds OCI-Subject to a manifest push's 201, as OCI distribution 1.1 asks of a
// registry with the referrers API (the registry package sends none).
type withSubject struct {
	http.ResponseWriter
	digest string
}

func (w *withSubject) WriteHeader(code int) {
	if code == http.StatusCreated {
		w.Header().Set("OCI-Subject", w.digest)
	}
	w.ResponseWriter.WriteHeader(code)
}

func (p *paged) servePage(w http.ResponseWriter, r *http.Request) {
	rec := httptest.NewRecorder()
	p.inner.ServeHTTP(rec, r)
	var index map[string]json.RawMessage
	var listed []map[string]any
	if rec.Code != http.StatusOK ||
		json.Unmarshal(rec.Body.Bytes(), &index) != nil ||
		json.Unmarshal(index["manifests"], &listed) != nil {
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		w.Write(rec.Body.Bytes())
		return
	}
	p.mu.Lock()
	sort.SliceStable(listed, func(i, j int) bool {
		return p.place(listed[i]) > p.place(listed[j]) // newest first
	})
	p.mu.Unlock()
	from, _ := strconv.Atoi(r.URL.Query().Get("cursor"))
	from = clamp(from, 0, len(listed))
	to := clamp(from+p.n, from, len(listed))
	if to < len(listed) {
		q := r.URL.Query()
		q.Set("cursor", strconv.Itoa(to))
		w.Header().Set("Link", fmt.Sprintf("<%s%s?%s>; rel=\"next\"", p.base, r.URL.Path, q.Encode()))
	}
	page, _ := json.Marshal(listed[from:to])
	index["manifests"] = page
	out, _ := json.Marshal(index)
	w.Header().Set("Content-Type", rec.Header().Get("Content-Type"))
	w.Header().Set("Content-Length", strconv.Itoa(len(out)))
	w.WriteHeader(http.StatusOK)
	w.Write(out)
}

// place is a listed descriptor's push's place in the order; -1 when its push was not seen.
func (p *paged) place(d map[string]any) int {
	digest, _ := d["digest"].(string)
	if at, ok := p.pushed[digest]; ok {
		return at
	}
	return -1
}

func clamp(v, lo, hi int) int {
	if v < lo {
		return lo
	}
	if v > hi {
		return hi
	}
	return v
}

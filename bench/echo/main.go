// Command echo is a bare HTTP/1.1 echo server used to calibrate "the bare
// HTTP limit of this machine" for `slipstream bench`: it answers every
// request, on any path and method, with 200 and the request body
// (content-type application/json). No dependencies beyond the standard
// library.
//
//	go -C bench/echo run . -addr 127.0.0.1:9100      # from the repo root
//	go -C bench/echo build -o /tmp/echo . && /tmp/echo -addr 127.0.0.1:9100
//
// (`go run ./bench/echo` from the root needs a go.work that uses ./bench/echo.)
package main

import (
	"bytes"
	"flag"
	"io"
	"log"
	"net/http"
	"strconv"
	"sync"
)

var bufPool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

func echo(w http.ResponseWriter, r *http.Request) {
	buf := bufPool.Get().(*bytes.Buffer)
	buf.Reset()
	defer bufPool.Put(buf)
	if _, err := buf.ReadFrom(r.Body); err != nil && err != io.EOF {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	h := w.Header()
	h["Content-Type"] = []string{"application/json"}
	h["Content-Length"] = []string{strconv.Itoa(buf.Len())}
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(buf.Bytes())
}

func main() {
	addr := flag.String("addr", "127.0.0.1:9100", "listen address (host:port)")
	flag.Parse()
	log.Printf("echo listening on http://%s", *addr)
	log.Fatal(http.ListenAndServe(*addr, http.HandlerFunc(echo)))
}

// Go's net/http through sluice, as users configure it: a Transport whose Proxy is
// sluice and whose TLS config trusts sluice's CA and the upstreams', in the three modes;
// HTTP/2 where the tunnel offers it (the Transport's default with ForceAttemptHTTP2),
// and `Expect: 100-continue` with ExpectContinueTimeout. Go's standard library has no
// WebSocket client, so there is no WebSocket check here.
//
// Run by tests/interop.rs: `go run clients.go PLAN.json`, with the CAs to trust in the PEM
// file SLUICE_INTEROP_BUNDLE names. Prints one JSON line per check.
package main

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"
)

type Mode struct {
	Base      string `json:"base"`
	BaseNamed string `json:"base_named"`
}

type Plan struct {
	Proxy string          `json:"proxy"`
	Modes map[string]Mode `json:"modes"`
}

var mb = make([]byte, 1<<20)
var mbSha string

func report(mode, check string, ok bool, detail string) {
	if len(detail) > 300 {
		detail = detail[:300]
	}
	line, _ := json.Marshal(map[string]any{"client": "go net/http", "mode": mode, "check": check, "ok": ok, "detail": detail})
	fmt.Println(string(line))
}

func run(mode, check string, fn func() (bool, string, error)) {
	ok, detail, err := fn()
	if err != nil {
		ok, detail = false, err.Error()
	}
	report(mode, check, ok, detail)
}

func inspect(body []byte) map[string]any {
	v := map[string]any{}
	_ = json.Unmarshal(body, &v)
	return v
}

func do(c *http.Client, method, u string, body io.Reader, header map[string]string) (*http.Response, []byte, error) {
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		return nil, nil, err
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, b, err
}

func suite(c *http.Client, mode, base string) {
	run(mode, "method, path, headers and body intact", func() (bool, string, error) {
		r, b, err := do(c, "POST", base+"/inspect/a/b?q=1", strings.NewReader("hello"), map[string]string{"X-Interop": "yes"})
		if err != nil {
			return false, "", err
		}
		v := inspect(b)
		h, _ := v["headers"].(map[string]any)
		ok := r.StatusCode == 200 && v["method"] == "POST" && v["path"] == "/inspect/a/b" && v["query"] == "q=1" &&
			h["x-interop"] == "yes" && v["body_len"] == float64(5)
		return ok, string(b), nil
	})
	run(mode, "keep-alive", func() (bool, string, error) {
		var got []int
		for i := 0; i < 3; i++ {
			r, _, err := do(c, "GET", fmt.Sprintf("%s/inspect/k%d", base, i), nil, nil)
			if err != nil {
				return false, "", err
			}
			got = append(got, r.StatusCode)
		}
		return fmt.Sprint(got) == "[200 200 200]", fmt.Sprint(got), nil
	})
	run(mode, "1 MiB upload", func() (bool, string, error) {
		_, b, err := do(c, "POST", base+"/inspect/upload", bytes.NewReader(mb), nil)
		if err != nil {
			return false, "", err
		}
		v := inspect(b)
		return v["body_sha256"] == mbSha, fmt.Sprint(v["body_len"]), nil
	})
	run(mode, "chunked upload", func() (bool, string, error) {
		// A reader of unknown length: the Transport sends it chunked.
		_, b, err := do(c, "POST", base+"/inspect/chunked", io.MultiReader(bytes.NewReader(mb)), nil)
		if err != nil {
			return false, "", err
		}
		v := inspect(b)
		h, _ := v["headers"].(map[string]any)
		return v["body_sha256"] == mbSha, fmt.Sprint(v["body_len"], " ", h["transfer-encoding"]), nil
	})
	if mode != "tunnel" {
		// In a blind tunnel the 100 is the upstream's to send: nothing of sluice's.
		run(mode, "Expect: 100-continue", func() (bool, string, error) {
			t := time.Now()
			r, b, err := do(c, "POST", base+"/inspect/expect", bytes.NewReader(mb), map[string]string{"Expect": "100-continue"})
			if err != nil {
				return false, "", err
			}
			v := inspect(b)
			took := time.Since(t)
			// ExpectContinueTimeout is 30 s: a missing 100 shows as a wait that long.
			return r.StatusCode == 200 && v["body_sha256"] == mbSha && took < 15*time.Second,
				fmt.Sprintf("%s %d in %v", r.Proto, r.StatusCode, took), nil
		})
	}
	run(mode, "HEAD, 204, 304", func() (bool, string, error) {
		var got []int
		for _, x := range [][2]string{{"HEAD", "/inspect/h"}, {"GET", "/status/204"}, {"GET", "/status/304"}} {
			r, _, err := do(c, x[0], base+x[1], nil, nil)
			if err != nil {
				return false, "", err
			}
			got = append(got, r.StatusCode)
		}
		return fmt.Sprint(got) == "[200 204 304]", fmt.Sprint(got), nil
	})
	run(mode, "streamed response", func() (bool, string, error) {
		t := time.Now()
		resp, err := c.Get(base + "/drip/4/300")
		if err != nil {
			return false, "", err
		}
		defer resp.Body.Close()
		buf := make([]byte, 64)
		if _, err := resp.Body.Read(buf); err != nil {
			return false, "", err
		}
		first := time.Since(t)
		io.Copy(io.Discard, resp.Body)
		total := time.Since(t)
		return first < total*8/10, fmt.Sprintf("first after %v of %v", first, total), nil
	})
	check := "429 retried for GET, not for a POST without a key"
	if mode == "tunnel" {
		check = "a 429 passed through as sent"
	}
	run(mode, check, func() (bool, string, error) {
		name := fmt.Sprintf("go%d", time.Now().UnixNano())
		g, _, err := do(c, "GET", base+"/seq/"+name+"g/429,200", nil, nil)
		if err != nil {
			return false, "", err
		}
		attempts := g.Header.Get("sluice-attempts")
		if mode == "tunnel" {
			return g.StatusCode == 429 && attempts == "", fmt.Sprint(g.StatusCode), nil
		}
		p, _, err := do(c, "POST", base+"/seq/"+name+"p/429,200", strings.NewReader("order"), nil)
		if err != nil {
			return false, "", err
		}
		return g.StatusCode == 200 && attempts == "2" && p.StatusCode == 429,
			fmt.Sprint(g.StatusCode, " ", attempts, " ", p.StatusCode), nil
	})
}

func main() {
	raw, err := os.ReadFile(os.Args[1])
	if err != nil {
		panic(err)
	}
	var plan Plan
	if err := json.Unmarshal(raw, &plan); err != nil {
		panic(err)
	}
	rand.Read(mb)
	sum := sha256.Sum256(mb)
	mbSha = hex.EncodeToString(sum[:])
	pem, err := os.ReadFile(os.Getenv("SLUICE_INTEROP_BUNDLE"))
	if err != nil {
		panic(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	proxy, _ := url.Parse(plan.Proxy)
	transport := &http.Transport{
		Proxy:                 http.ProxyURL(proxy),
		TLSClientConfig:       &tls.Config{RootCAs: roots},
		ForceAttemptHTTP2:     true,
		ExpectContinueTimeout: 30 * time.Second,
	}
	client := &http.Client{Transport: transport, Timeout: 60 * time.Second}
	for _, mode := range []string{"forward", "intercept", "tunnel"} {
		suite(client, mode, plan.Modes[mode].Base)
	}
}

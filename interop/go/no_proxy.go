// Which hosts Go's net/http sends through the proxy with the shipped NO_PROXY: a
// Transport with http.ProxyFromEnvironment (what the default transport uses) and a dialer
// that connects to the proxy and to nothing else, so nothing leaves loopback.
//
// Run by tests/interop.rs: `go run no_proxy.go PLAN.json` (the proxy URL, the NO_PROXY
// value, the hosts). Prints one JSON line per host: {"client", "host", "via"}.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"time"
)

func main() {
	var plan struct {
		Proxy   string   `json:"proxy"`
		NoProxy string   `json:"no_proxy"`
		Hosts   []string `json:"hosts"`
	}
	raw, err := os.ReadFile(os.Args[1])
	if err == nil {
		err = json.Unmarshal(raw, &plan)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	// Read once, at the first request: set before it.
	for _, k := range []string{"HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"} {
		os.Setenv(k, plan.Proxy)
	}
	os.Setenv("NO_PROXY", plan.NoProxy)
	os.Setenv("no_proxy", plan.NoProxy)
	proxy, _ := url.Parse(plan.Proxy)
	for _, host := range plan.Hosts {
		direct := false
		dialer := &net.Dialer{Timeout: 5 * time.Second}
		transport := &http.Transport{
			Proxy: http.ProxyFromEnvironment,
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				if addr != proxy.Host {
					direct = true
					return nil, errors.New("a direct connection (refused by the test)")
				}
				return dialer.DialContext(ctx, network, addr)
			},
		}
		client := &http.Client{Transport: transport, Timeout: 10 * time.Second}
		via := ""
		resp, err := client.Get("http://" + host + ":9/probe/go")
		switch {
		case direct:
			via = "direct"
		case err != nil:
			via = "error: " + err.Error()
		case resp.StatusCode == 403:
			via = "proxy"
		default:
			via = fmt.Sprintf("error: %d", resp.StatusCode)
		}
		if resp != nil {
			resp.Body.Close()
		}
		transport.CloseIdleConnections()
		line, _ := json.Marshal(map[string]string{"client": "go", "host": host, "via": via})
		fmt.Println(string(line))
	}
}

"""The provider matrix (see algorithms.sh): real rate limiters at a published limit of
10 requests per second, each configured as its own documentation writes it, behind
sluice configured with each kind a user might write at the same numbers. Each cell:
CLIENTS clients through one sluice (release build, default log level, stderr read
through a pipe) send as fast as it lets them for SECONDS, retries off, so every 429 the
limiter answers reaches a client. Prints a Markdown table: 429s of requests sent, and
the limit used: requests accepted over what the limiter accepts at most in that time
from rest (its burst, then 10 a second).

A row's cells run at once, each with its own limiter process and its own sluice; the
load is light (10 requests a second each), so they do not disturb each other.
"""

import os
import sys
import tempfile
import threading
import time
import http.client

from common import ROOT, Procs, start_sluice

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 30
CLIENTS = 20
RATE = 10
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "limiter_server.py")

# The kinds a user might write for "10 per second", as docs/config.md writes them.
KINDS = [
    ("sliding_window", '{ kind = "sliding_window", permits = 10, window = "1s" }'),
    ("sliding_counter", '{ kind = "sliding_counter", permits = 10, window = "1s" }'),
    ("sliding_counter clock",
     '{ kind = "sliding_counter", permits = 10, window = "1s", align = "clock" }'),
    ("fixed_window", '{ kind = "fixed_window", permits = 10, window = "1s" }'),
    ("fixed_window clock",
     '{ kind = "fixed_window", permits = 10, window = "1s", align = "clock" }'),
    ("token_bucket burst 10", '{ kind = "token_bucket", rate = 10, per = "1s", burst = 10 }'),
    ("token_bucket burst 1", '{ kind = "token_bucket", rate = 10, per = "1s", burst = 1 }'),
    ("leaky_bucket", '{ kind = "leaky_bucket", rate = 10, per = "1s", burst = BURST }'),
    ("published", '{ kind = "published", permits = 10, window = "1s" }'),
]


def haproxy(procs, work, port, _burst):
    cfg = os.path.join(work, "haproxy.cfg")
    with open(cfg, "w") as f:
        f.write(f"""global
    maxconn 256
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend api
    bind 127.0.0.1:{port}
    http-request track-sc0 src table per_client
    http-request deny deny_status 429 if {{ sc_http_req_rate(0) gt {RATE} }}
    http-request return status 200 content-type text/plain string ok
backend per_client
    stick-table type ip size 1k expire 10s store http_req_rate(1s)
""")
    procs.start(["haproxy", "-f", cfg, "-db"])
    return "/"


def nginx(procs, work, port, burst):
    os.makedirs(os.path.join(work, "www"))
    with open(os.path.join(work, "www", "ok"), "w") as f:
        f.write("ok\n")
    arg = f" burst={burst} nodelay" if burst else ""
    conf = os.path.join(work, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"""daemon off; master_process off; worker_processes 1;
pid {work}/nginx.pid; error_log {work}/error.log;
events {{ worker_connections 256; }}
http {{
  access_log off;
  client_body_temp_path {work}/body;
  limit_req_zone $binary_remote_addr zone=api:1m rate={RATE}r/s;
  limit_req_status 429;
  server {{
    listen 127.0.0.1:{port};
    root {work}/www;
    location / {{ limit_req zone=api{arg}; }}
  }}
}}
""")
    procs.start(["nginx", "-p", work + "/", "-c", conf, "-e", "stderr"])
    return "/ok"


def python(kind, rate):
    def start(procs, _work, port, _burst):
        procs.start([sys.executable, FIXTURE, str(port), kind, rate])
        return "/"
    return start


# Each limiter: how to start it, its burst from rest, the kind docs/config.md says to
# write for it.
ROWS = [
    ("haproxy `sc_http_req_rate` (1 s)", haproxy, 0, RATE, "sliding_counter"),
    ("limits sliding window counter", python("limits:sliding-window-counter", "10/second"), 0,
     RATE, "sliding_counter clock"),
    ("limits fixed window", python("limits:fixed-window", "10/second"), 0, RATE,
     "fixed_window"),
    ("limits moving window", python("limits:moving-window", "10/second"), 0, RATE,
     "sliding_window"),
    ("django-ratelimit (clock windows)", python("django", "10/s"), 0, RATE,
     "fixed_window clock"),
    ("nginx `limit_req` 10r/s", nginx, 0, 1, "leaky_bucket"),
    ("nginx `limit_req` 10r/s burst=5 nodelay", nginx, 5, 6, "leaky_bucket"),
]


def wait_port(port):
    import socket
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on {port}")


def client(proxy_port, url, until, out):
    conn = http.client.HTTPConnection("127.0.0.1", proxy_port, timeout=60)
    while time.monotonic() < until:
        try:
            conn.request("GET", url)
            r = conn.getresponse()
            r.read()
            out.append(r.status)
        except OSError:
            out.append(0)
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", proxy_port, timeout=60)
    conn.close()


def cell(row, kind, index, results):
    name, start, burst, allowed, _ = row
    procs = Procs()
    work = tempfile.mkdtemp(prefix="sluice-alg-")
    try:
        upstream_port = 22000 + index
        path = start(procs, work, upstream_port, burst)
        wait_port(upstream_port)
        proxy_port, admin_port = 23000 + index, 24000 + index
        limit = dict(KINDS)[kind].replace("BURST", str(burst))
        config = os.path.join(work, "sluice.toml")
        with open(config, "w") as f:
            f.write(f"""[proxy]
listen = "127.0.0.1:{proxy_port}"
admin = "127.0.0.1:{admin_port}"
[egress]
allow = ["127.0.0.1"]
[[upstream]]
name = "provider"
hosts = ["127.0.0.1"]
limits = [{limit}]
[upstream.retry]
max_attempts = 1
""")
        start_sluice(procs, config)
        wait_port(proxy_port)
        url = f"http://127.0.0.1:{upstream_port}{path}"
        statuses = []
        t0 = time.monotonic()
        threads = [threading.Thread(target=client, args=(proxy_port, url, t0 + SECONDS, statuses))
                   for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        ok = statuses.count(200)
        refused = statuses.count(429)
        other = len(statuses) - ok - refused
        used = ok / (allowed + RATE * elapsed)
        results[(name, kind)] = (refused, len(statuses), used, other)
    finally:
        procs.stop_all()


def main():
    results = {}
    # ONLY=django,nginx: the rows whose name contains one of these.
    only = [o for o in os.environ.get("ONLY", "").split(",") if o]
    rows = [row for row in ROWS if not only or any(o in row[0] for o in only)]
    for r, row in enumerate(rows):
        threads = [threading.Thread(target=cell, args=(row, kind, r * 20 + k, results))
                   for k, (kind, _) in enumerate(KINDS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(f"{row[0]}: done", file=sys.stderr)
    print(f"{SECONDS:.0f} s per cell, {CLIENTS} clients, retries off; "
          "each cell: 429s of requests sent, share of the limit used "
          "(**bold**: the kind docs/config.md says to write)\n")
    print("| limiter (10 per second) | " + " | ".join(k for k, _ in KINDS) + " |")
    print("| --- |" + " --- |" * len(KINDS))
    for row in rows:
        cells = []
        for kind, _ in KINDS:
            refused, sent, used, other = results[(row[0], kind)]
            text = f"{refused} of {sent}, {used * 100:.1f}%"
            if other:
                text += f" ({other} other)"
            if kind == row[4]:
                text = f"**{text}**"
            cells.append(text)
        print(f"| {row[0]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""A finite batch through shared limits, as a new user tries one: N requests fired at
once with curl (one process each, as `xargs -P` does), split between replicas of
release sluice as shipped (default workers and log level, stderr read through a pipe)
sharing a token bucket of 10/s with a burst of 1 through one redis-server. The upstream
logs each arrival; a GCRA at the same limit judges them. Utilisation: the requests over
what the limit allows in the time the batch took end to end (N / (seconds x 10))."""

import http.server
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Procs, start_sluice, wait_http  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
N = int(sys.argv[2]) if len(sys.argv) > 2 else 100
RATE = 10.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


arrivals = []


class Logged(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        arrivals.append(time.monotonic())
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def refused(times):
    """Arrivals a GCRA of RATE/s with a burst of 1 refuses."""
    tat, out = None, 0
    for t in sorted(times):
        if tat is not None and t < tat - 1e-6:
            out += 1
            continue
        tat = max(tat or t, t) + 1 / RATE
    return out


def main():
    procs = Procs()
    work = tempfile.mkdtemp(prefix="sluice-batch-")
    up_port, redis_port = free_port(), free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", up_port), Logged)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    procs.start(["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"])
    time.sleep(0.3)
    try:
        print("| replicas | round | end to end s | first to last arrival s | refused | utilisation |")
        print("| --- | --- | --- | --- | --- | --- |")
        for replicas in (2, 1):
            ports, sluices = [], []
            for i in range(replicas):
                listen, admin = free_port(), free_port()
                conf = os.path.join(work, f"r{replicas}-{i}.toml")
                with open(conf, "w") as f:
                    f.write(f"""[proxy]
listen = "127.0.0.1:{listen}"
admin = "127.0.0.1:{admin}"

[[upstream]]
name = "api"
hosts = ["127.0.0.1"]
limits = [{{ kind = "token_bucket", rate = 10, per = "1s", burst = 1, scope = "global" }}]

[cluster]
redis = "redis://127.0.0.1:{redis_port}"
replicas = {replicas}
""")
                sluices.append(start_sluice(procs, conf))
                wait_http(f"http://127.0.0.1:{admin}/readyz")
                ports.append(listen)
            for r in range(ROUNDS):
                subprocess.run(["redis-cli", "-p", str(redis_port), "FLUSHALL"],
                               stdout=subprocess.DEVNULL, check=True)
                time.sleep(1)
                arrivals.clear()
                t0 = time.monotonic()
                curls = [subprocess.Popen(
                    ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-x",
                     f"http://127.0.0.1:{ports[k % replicas]}",
                     f"http://127.0.0.1:{up_port}/v1/items/{k}"],
                    stdout=subprocess.PIPE) for k in range(N)]
                codes = [c.communicate()[0].decode() for c in curls]
                took = time.monotonic() - t0
                bad = [c for c in codes if c != "200"]
                if bad:
                    raise SystemExit(f"answers other than 200: {bad[:5]}")
                span = max(arrivals) - min(arrivals)
                print(f"| {replicas} | {r + 1} | {took:.2f} | {span:.2f} | {refused(arrivals)} | "
                      f"{N / (took * RATE) * 100:.1f}% |", flush=True)
            for p in sluices:
                procs.stop(p)
    finally:
        procs.stop_all()
        server.shutdown()


main()

"""HTTP/2 (or with --h1, HTTP/1.1) through interception, sluice next to haproxy (see h2.sh).

h2load speaks no HTTP proxy protocol, so each proxy is reached through one socat hop:
for sluice, socat opens a CONNECT tunnel (`PROXY:` address) to the TLS upstream, which
sluice intercepts (TLS with its CA, HTTP/2 by ALPN) and forwards over a TLS connection
of its own; for haproxy, socat relays TCP to a frontend that ends TLS and HTTP/2 with a
certificate of the same CA and forwards over TLS. The same hop in front of both, so
neither pays for it alone. The upstream is nginx over TLS, HTTP/1.1, `return 200`.

sluice runs as shipped (the bundled config plus one intercepted upstream, an access line
per request, stderr through a pipe); haproxy with as many threads as sluice has workers,
its defaults otherwise, no log. Rounds interleave; medians of rounds: req/s, p50 and p99
from h2load's per-request log, and the proxy's CPU and context switches (every thread's,
voluntary and preempted) per request; socat's are not counted.

`--instructions [connections=2] [streams=8]` counts instead: sluice alone under
callgrind (one worker, as shipped otherwise), 2,000 requests uncounted, then N (default
10,000) over that many connections and concurrent streams on each (`1 1`: a client that
sends one request at a time); it prints user-space instructions per request, every
thread's. PROFILE=1 adds perf's cpu-clock profile of sluice under the load before the
rounds.

`--h1` makes h2load speak HTTP/1.1 over TLS (ALPN `http/1.1`), so sluice intercepts an
HTTP/1.1 tunnel and haproxy ends TLS and HTTP/1.1; the streams argument is then requests
pipelined on a connection, 1 by default (a client that waits for each answer).
"""

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    SLUICE,
    Procs,
    callgrind_counts,
    callgrind_dump,
    context_switches,
    cpu_seconds,
    family_pids,
    haproxy_config,
    hello_nginx,
    round_order,
    shipped_config,
    start_sluice,
    start_under_callgrind,
    wait_http,
    wait_slow,
)

INSTRUCTIONS = "--instructions" in sys.argv
H1 = "--h1" in sys.argv
PROTO = ["--h1"] if H1 else []
NAME = "HTTP/1.1" if H1 else "HTTP/2"
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
ROUNDS = int(ARGS[0]) if len(ARGS) > 0 else 5
SECONDS = int(ARGS[1]) if len(ARGS) > 1 else 5
CONNS = int(ARGS[2]) if len(ARGS) > 2 else (32 if H1 else 8)
STREAMS = int(ARGS[3]) if len(ARGS) > 3 else (1 if H1 else 16)
# `--instructions [connections] [streams]`: h2load's shape while counting.
COUNT_CONNS = int(ARGS[0]) if INSTRUCTIONS and len(ARGS) > 0 else 2
COUNT_STREAMS = int(ARGS[1]) if INSTRUCTIONS and len(ARGS) > 1 else (1 if H1 else 8)
COUNTED = int(os.environ.get("N", "10000"))
WORKERS = len(os.sched_getaffinity(0))
UP, SLUICE_PORT, ADMIN, HAPROXY, HOP_SLUICE, HOP_HAPROXY = 18140, 13200, 19995, 13201, 13202, 13203


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True)


def certificates(work):
    """A CA for the upstream and haproxy's frontend, and a leaf for 127.0.0.1 it signs."""
    ca, ca_key, leaf, key = (os.path.join(work, n) for n in ("up-ca.pem", "up-ca.key", "leaf.pem", "leaf.key"))
    sh("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
       "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=bench upstream CA")
    sh("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", key,
       "-out", leaf + ".csr", "-subj", "/CN=127.0.0.1")
    ext = os.path.join(work, "ext.cnf")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    sh("openssl", "x509", "-req", "-in", leaf + ".csr", "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
       "-out", leaf, "-days", "2", "-extfile", ext)
    combined = os.path.join(work, "haproxy.pem")
    with open(combined, "w") as f:
        f.write(open(leaf).read() + open(key).read())
    return ca, leaf, key, combined


def h2load(port, log):
    out = subprocess.run(
        ["h2load", *PROTO, f"-c{CONNS}", f"-m{STREAMS}", f"-D{SECONDS}", "--warm-up-time=1", f"--log-file={log}",
         f"--connect-to=127.0.0.1:{port}", f"https://127.0.0.1:{UP}/"],
        capture_output=True, text=True, check=True).stdout
    if " 0 failed" not in out or " 0 errored" not in out:
        raise SystemExit(out)
    latencies = []
    for line in open(log):
        f = line.split()
        if len(f) >= 3:
            if f[1] == "0":
                continue  # still in flight when the duration ended
            if f[1] != "200":
                raise SystemExit(f"status {f[1]} in {log}")
            latencies.append(int(f[2]) / 1000)
    latencies.sort()
    pct = lambda p: latencies[min(len(latencies) - 1, int(len(latencies) * p))]  # noqa: E731
    rate = float(re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out).group(1))
    return rate, pct(0.5), pct(0.99)


def instructions(procs, work, path):
    """User-space instructions per intercepted request, counted under callgrind."""
    p = start_under_callgrind(procs, work, path)
    wait_slow(f"http://127.0.0.1:{ADMIN}/readyz")
    procs.start(["socat", f"TCP-LISTEN:{HOP_SLUICE},bind=127.0.0.1,fork,reuseaddr",
                 f"PROXY:127.0.0.1:127.0.0.1:{UP},proxyport={SLUICE_PORT}"])
    time.sleep(1)

    def load(n):
        out = subprocess.run(["h2load", *PROTO, f"-c{COUNT_CONNS}", f"-m{COUNT_STREAMS}", f"-n{n}", f"--connect-to=127.0.0.1:{HOP_SLUICE}",
                              f"https://127.0.0.1:{UP}/"], capture_output=True, text=True, check=True).stdout
        if f"{n} succeeded" not in out:
            raise SystemExit(out)

    load(2000)
    sh("callgrind_control", "-z", str(p.pid))
    load(COUNTED)
    dump = callgrind_dump(work, p.pid)
    total, _ = callgrind_counts(dump)
    print(f"instructions per intercepted {NAME} request: {total / COUNTED:,.0f} ({COUNTED} counted, "
          f"h2load -c{COUNT_CONNS} -m{COUNT_STREAMS})")
    if os.environ.get("KEEP"):
        shutil.copy(dump, os.environ["KEEP"])


def main():
    procs = Procs()
    work = tempfile.mkdtemp(prefix="sluice-h2-")
    try:
        ca, leaf, key, combined = certificates(work)
        hello_nginx(procs, work, [UP], tls=(leaf, key))
        sh(SLUICE, "ca", "new", "--out", os.path.join(work, "sluice-ca"))
        path = shipped_config(work, "sluice.toml", SLUICE_PORT, ADMIN)
        with open(path, "a") as f:
            f.write(f"""
[tls]
ca_cert = "{work}/sluice-ca/ca.pem"
ca_key = "{work}/sluice-ca/ca-key.pem"

[[upstream]]
name = "bench-tls"
hosts = ["127.0.0.1:{UP}"]
tls = "intercept"
upstream_ca = "{ca}"
""")
        if INSTRUCTIONS:
            return instructions(procs, work, path)
        sluice = start_sluice(procs, path)
        wait_http(f"http://127.0.0.1:{ADMIN}/readyz")
        hcfg = haproxy_config(work, "haproxy.cfg", HAPROXY, UP, WORKERS,
                              bind=f"ssl crt {combined} alpn h2,http/1.1",
                              server=f"ssl verify required ca-file {ca}")
        h = procs.start(["haproxy", "-db", "-f", hcfg])
        procs.start(["socat", f"TCP-LISTEN:{HOP_SLUICE},bind=127.0.0.1,fork,reuseaddr",
                     f"PROXY:127.0.0.1:127.0.0.1:{UP},proxyport={SLUICE_PORT}"])
        procs.start(["socat", f"TCP-LISTEN:{HOP_HAPROXY},bind=127.0.0.1,fork,reuseaddr",
                     f"TCP:127.0.0.1:{HAPROXY}"])
        time.sleep(1)
        procs.check_alive()
        targets = [("sluice as shipped (intercepted)", HOP_SLUICE, sluice.pid),
                   (f"haproxy, {WORKERS} threads (TLS and {NAME} ended)", HOP_HAPROXY, h.pid)]
        if os.environ.get("PROFILE"):
            # PROFILE=1: where sluice's CPU goes under this load, from perf's cpu-clock samples.
            data = os.path.join(work, "perf.data")
            load = subprocess.Popen(["h2load", *PROTO, f"-c{CONNS}", f"-m{STREAMS}", f"-D{SECONDS + 2}",
                                     f"--connect-to=127.0.0.1:{HOP_SLUICE}", f"https://127.0.0.1:{UP}/"],
                                    stdout=subprocess.DEVNULL)
            time.sleep(1)
            sh("perf", "record", "-q", "-e", "cpu-clock", "-F", "4000", "-p", str(sluice.pid), "-o", data,
               "--", "sleep", str(SECONDS))
            load.wait()
            report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso,symbol",
                                     "--stdio", "-q", "--percent-limit", "0.7"],
                                    capture_output=True, text=True).stdout
            for line in report.splitlines():
                print(" ".join(line.split()[:4])[:140])
        results = {name: [] for name, _, _ in targets}
        for name, port, _ in targets:
            h2load(port, os.path.join(work, "warm.log"))
        for r in range(ROUNDS):
            for name, port, pid in round_order(targets, r):
                pids = family_pids(pid)
                before = cpu_seconds(pids)
                switched = sum(context_switches(pids))
                t0 = time.monotonic()
                rate, p50, p99 = h2load(port, os.path.join(work, "h2load.log"))
                # CPU and switches over the whole h2load run, warm-up second included.
                cpu = cpu_seconds(pids) - before
                switched = sum(context_switches(pids)) - switched
                elapsed = time.monotonic() - t0
                results[name].append((rate, p50, p99, cpu / (rate * elapsed) * 1e6,
                                      switched / (rate * elapsed)))
                print(f"round {r + 1} {name}: {rate:.0f} req/s", file=sys.stderr)
        print(f"\nh2load {' '.join(PROTO)} -c{CONNS} -m{STREAMS}, {ROUNDS} rounds × {SECONDS} s interleaved; medians (min–max)\n")
        print("| target | req/s | p50 ms | p99 ms | proxy CPU µs per request | proxy's context switches per request |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, _, _ in targets:
            cols = list(zip(*results[name]))
            cell = lambda v, f: f"{f.format(statistics.median(v))} ({f.format(min(v))}–{f.format(max(v))})"  # noqa: E731
            print(f"| {name} | {cell(cols[0], '{:.0f}')} | {cell(cols[1], '{:.2f}')} | {cell(cols[2], '{:.2f}')} | "
                  f"{cell(cols[3], '{:.1f}')} | {cell(cols[4], '{:.3f}')} |")
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)


main()

"""Counts user-space instructions per proxied request under callgrind (see callgrind.sh).

Exact and repeatable where wall-clock throughput on a shared machine is not: one worker
thread, a warm-up that is not counted, then a counted run whose total `Ir` is divided by
the requests wrk completed, with the calls into the C allocator counted the same way.
Prints one line per target, and with --top the functions with
the largest inclusive share.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

from common import (
    SLUICE,
    Procs,
    absolute_form_script,
    callgrind_counts,
    callgrind_dump,
    haproxy_config,
    hello_nginx,
    passthrough_config,
    require_binary,
    wait_http,
    wait_slow,
    wrk_argv,
)

SECONDS = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 8
TOP = "--top" in sys.argv or "--self" in sys.argv
HAPROXY = "--haproxy" in sys.argv
# CONNS: wrk's connections (4 by default).
CONNS = int(os.environ.get("CONNS", "4"))
HAPROXY_PORT = 13139
SELF = "--self" in sys.argv
NGINX_PORT, NGINX_PORT_MATCHED = 18090, 18091
PROXY_PORT, ADMIN_PORT = 13138, 19911

# CACHE=1: simulate the caches too, and print data references and misses per request.
CACHE = ["--cache-sim=yes"] if os.environ.get("CACHE") else []
work = tempfile.mkdtemp(prefix="sluice-cg-")
procs = Procs()


def wrk(script, seconds, url=f"http://127.0.0.1:{PROXY_PORT}"):
    out = subprocess.run(
        wrk_argv(url, CONNS, seconds, script, threads=1),
        capture_output=True, text=True, check=True,
    ).stdout
    if "Non-2xx" in out:
        raise SystemExit(out)
    return int(re.search(r"(\d+) requests in", out).group(1))


def measure(name, script, pid, url=f"http://127.0.0.1:{PROXY_PORT}"):
    wrk(script, 3, url)
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    requests = wrk(script, SECONDS, url)
    dump = callgrind_dump(work, pid)
    _, allocs = callgrind_counts(dump)
    # --threshold=100: every function; the default stops once 99% is covered, which the
    # first inclusive row (the runtime) already is.
    annotate = ["callgrind_annotate", "--auto=no", "--threshold=100",
                f"--inclusive={'no' if SELF else 'yes'}", dump]
    out = subprocess.run(annotate, capture_output=True, text=True, check=True).stdout
    if os.environ.get("KEEP"):
        shutil.copy(dump, os.environ["KEEP"] + "." + name.split()[0])
    total = int(re.search(r"^\s*([\d,]+) \(100.0%\).*PROGRAM TOTALS", out, re.M).group(1).replace(",", ""))
    print(f"| {name} | {requests} | {total / requests / 1000:.1f}k | {allocs / requests:.1f} |")
    if CACHE:
        events = re.search(r"^Events shown:\s+(.+)$", out, re.M).group(1).split()
        line = re.search(r"^(.+)PROGRAM TOTALS", out, re.M).group(1)
        values = [int(v.replace(",", "")) for v in re.findall(r"([\d,]+) \(", line)]
        print("    " + "  ".join(f"{e}={v / requests:,.0f}" for e, v in zip(events, values)))
    if TOP:
        rows = re.findall(r"^\s*([\d,]+) \(\s*([\d.]+)%\)\s+(?:\S+:)?(.+?)(?: \[|$)", out, re.M)
        rows = [r for r in rows if "PROGRAM TOTALS" not in r[2]]
        for ir, pct, fn in rows[:60]:
            print(f"    {pct:>5}%  {fn[:150]}")


def main():
    require_binary(SLUICE)
    hello_nginx(procs, work, [NGINX_PORT, NGINX_PORT_MATCHED])
    sluice_conf = passthrough_config(work, PROXY_PORT, ADMIN_PORT, NGINX_PORT_MATCHED)
    # BENCH_LOG=shipped: the default log level (an access line per request), stderr read
    # through a pipe; otherwise RUST_LOG=warn, no access lines. Every thread's
    # instructions count, the log writer's too.
    env = {**os.environ, "SLUICE_WORKERS": "1"}
    env.pop("RUST_LOG", None)
    shipped = os.environ.get("BENCH_LOG") == "shipped"
    if not shipped:
        env["RUST_LOG"] = "warn"
    sluice = subprocess.Popen(
        ["valgrind", "--tool=callgrind", *CACHE, f"--callgrind-out-file={work}/cg.out",
         SLUICE, "run", "-c", sluice_conf],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    procs.started.append(sluice)
    threading.Thread(target=lambda: [None for _ in iter(lambda: sluice.stderr.read1(1 << 16), b"")],
                     daemon=True).start()
    print(f"log: {'as shipped (access lines to a pipe)' if shipped else 'off (RUST_LOG=warn)'}")
    wait_http(f"http://127.0.0.1:{NGINX_PORT}/")
    wait_slow(f"http://127.0.0.1:{ADMIN_PORT}/readyz")
    print("| target | requests counted | instructions per request | allocations per request |")
    print("| --- | --- | --- | --- |")
    for name, port in [("unmatched host", NGINX_PORT), ("matched upstream + generous limit", NGINX_PORT_MATCHED)]:
        measure(name, absolute_form_script(work, port), sluice.pid)
    if HAPROXY:
        # The same upstream behind haproxy (one thread, its defaults, no log), counted the
        # same way: the instruction count a proxy of the same job needs.
        conf = haproxy_config(work, "haproxy.cfg", HAPROXY_PORT, NGINX_PORT, 1)
        peer = procs.start(["valgrind", "--tool=callgrind", *CACHE, f"--callgrind-out-file={work}/cg.out",
                            "haproxy", "-db", "-f", conf])
        wait_slow(f"http://127.0.0.1:{HAPROXY_PORT}/")
        measure("haproxy, 1 thread (reverse)", None, peer.pid, f"http://127.0.0.1:{HAPROXY_PORT}/")


try:
    main()
finally:
    procs.stop_all()
    shutil.rmtree(work, ignore_errors=True)

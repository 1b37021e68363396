"""The latency tail next to haproxy, and where it comes from (see tail.sh).

Each round runs, per target, wrk -t1 and then the closed-loop client (examples/
closed_loop.rs), 32 connections each. The client writes every request down, so its
slow requests (over 2 ms) can be placed: a 10 ms stretch in which at least eight
requests of at least eight connections were slow is a stall; it is a whole-client stall
when it caught more than three quarters of the connections (the client or the machine
stopped), else a partial one (some of the proxy's connections stopped: with sluice, one
worker's half).
"""

import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import (
    TARGET,
    Procs,
    absolute_form_script,
    haproxy_config,
    hello_nginx,
    shipped_config,
    start_sluice,
    wait_http,
    wrk,
)

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
SECONDS = int(sys.argv[2]) if len(sys.argv) > 2 else 6
CONNS = 32
UP, PROXY, ADMIN, HAPROXY = 18460, 18461, 18462, 18463
CLIENT = os.path.join(TARGET, "release", "examples", "closed_loop")


def pct(sorted_values, p):
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * p / 100))]


def closed_loop(addr, request):
    out = subprocess.run([CLIENT, addr, str(CONNS), str(SECONDS), request],
                         capture_output=True, text=True, check=True).stdout
    rows = [tuple(map(int, line.split())) for line in out.splitlines()]
    lat = sorted(r[2] for r in rows)
    slow = [(at // 10_000, conn) for conn, at, latency in rows if latency > 2000]
    by_stretch = collections.defaultdict(list)
    for stretch, conn in slow:
        by_stretch[stretch].append(conn)
    whole = partial = 0
    for conns in by_stretch.values():
        if len(conns) >= 8 and len(set(conns)) >= 8:
            if len(set(conns)) > CONNS * 3 // 4:
                whole += len(conns)
            else:
                partial += len(conns)
    return {
        "rps": len(rows) / SECONDS,
        "p50": pct(lat, 50) / 1000, "p99": pct(lat, 99) / 1000, "p999": pct(lat, 99.9) / 1000,
        "slow": len(slow) / len(rows) * 1000, "whole": whole / len(rows) * 1000,
        "partial": partial / len(rows) * 1000,
    }


def main():
    work = tempfile.mkdtemp(prefix="sluice-tail-")
    procs = Procs()
    try:
        hello_nginx(procs, work, [UP])
        start_sluice(procs, shipped_config(work, "sluice.toml", PROXY, ADMIN))
        procs.start(["haproxy", "-db", "-f", haproxy_config(work, "haproxy.cfg", HAPROXY, UP, 2)])
        wait_http(f"http://127.0.0.1:{UP}/")
        wait_http(f"http://127.0.0.1:{ADMIN}/readyz")
        wait_http(f"http://127.0.0.1:{HAPROXY}/")
        targets = [
            ("sluice as shipped (forward)", f"http://127.0.0.1:{PROXY}",
             absolute_form_script(work, UP), f"127.0.0.1:{PROXY}",
             f"GET http://127.0.0.1:{UP}/ HTTP/1.1\\r\\nHost: 127.0.0.1:{UP}\\r\\n\\r\\n"),
            ("haproxy, 2 threads (reverse)", f"http://127.0.0.1:{HAPROXY}/", None,
             f"127.0.0.1:{HAPROXY}", f"GET / HTTP/1.1\\r\\nHost: 127.0.0.1:{UP}\\r\\n\\r\\n"),
        ]
        results = collections.defaultdict(list)
        for r in range(ROUNDS):
            for name, url, script, addr, request in targets:
                rps, p50, p99 = wrk(url, CONNS, SECONDS, script, threads=1)
                results[name, "wrk"].append({"rps": rps, "p50": p50, "p99": p99})
                time.sleep(1)
                results[name, "loop"].append(closed_loop(addr, request))
                procs.check_alive()
                print(f"round {r + 1} {name}: wrk {rps:.0f} req/s p99 {p99:.2f} ms; "
                      f"closed loop {results[name, 'loop'][-1]['rps']:.0f} req/s "
                      f"p99 {results[name, 'loop'][-1]['p99']:.2f} ms", flush=True)
                time.sleep(1)
        print(f"\n32 connections, {ROUNDS} rounds × {SECONDS} s interleaved, medians; "
              "slow = over 2 ms, per 1000 requests\n")
        print("| target | client | req/s | p50 ms | p99 ms | p99.9 ms | slow | in whole-client stalls | in partial stalls |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, *_ in targets:
            w = results[name, "wrk"]
            print(f"| {name} | wrk -t1 | {statistics.median([x['rps'] for x in w]):.0f} | "
                  f"{statistics.median([x['p50'] for x in w]):.2f} | {statistics.median([x['p99'] for x in w]):.2f} "
                  "| – | – | – | – |")
            c = results[name, "loop"]
            m = {k: statistics.median([x[k] for x in c]) for k in c[0]}
            print(f"| {name} | closed loop | {m['rps']:.0f} | {m['p50']:.2f} | {m['p99']:.2f} | "
                  f"{m['p999']:.2f} | {m['slow']:.1f} | {m['whole']:.1f} | {m['partial']:.1f} |")
    finally:
        procs.stop_all()


main()

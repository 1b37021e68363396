"""Runs the pass-through benchmark (see passthrough.sh) and prints a Markdown table.

Targets are interleaved (A B C A B C ...) so that noise from the shared machine spreads
over all of them; each figure is the median of the rounds with the min-max beside it.
"""

import os
import shutil
import statistics
import sys
import tempfile

from common import (
    SLUICE,
    Procs,
    absolute_form_script,
    cpu_seconds,
    hello_nginx,
    passthrough_config,
    rss_kib,
    wait_http,
    wrk,
)

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
SECONDS = int(sys.argv[2]) if len(sys.argv) > 2 else 10
CONNS = int(sys.argv[3]) if len(sys.argv) > 3 else 32
NGINX_PORT, NGINX_PORT_MATCHED = 18080, 18081
PROXY_PORT, ADMIN_PORT = 13128, 19901

work = tempfile.mkdtemp(prefix="sluice-bench-")
procs = Procs()


def main():
    hello_nginx(procs, work, [NGINX_PORT, NGINX_PORT_MATCHED])
    sluice_conf = passthrough_config(work, PROXY_PORT, ADMIN_PORT, NGINX_PORT_MATCHED)
    sluice = procs.start([SLUICE, "run", "-c", sluice_conf], env={**os.environ, "RUST_LOG": "warn"})
    wait_http(f"http://127.0.0.1:{NGINX_PORT_MATCHED}/")
    wait_http(f"http://127.0.0.1:{ADMIN_PORT}/readyz")
    procs.check_alive()

    scripts = {
        "unmatched": absolute_form_script(work, NGINX_PORT),
        "matched": absolute_form_script(work, NGINX_PORT_MATCHED),
    }

    targets = [
        ("direct", f"http://127.0.0.1:{NGINX_PORT}/", None),
        ("sluice, unmatched host", f"http://127.0.0.1:{PROXY_PORT}", scripts["unmatched"]),
        ("sluice, matched upstream + family, generous limit", f"http://127.0.0.1:{PROXY_PORT}", scripts["matched"]),
    ]
    results = {t[0]: [] for t in targets}
    cpu = {t[0]: [] for t in targets}
    wrk(targets[1][1], CONNS, SECONDS, targets[1][2])  # warm the pool and the page cache
    for r in range(ROUNDS):
        for name, url, script in targets:
            before = cpu_seconds([sluice.pid])
            results[name].append(wrk(url, CONNS, SECONDS, script))
            cpu[name].append((cpu_seconds([sluice.pid]) - before) / SECONDS * 100)
            print(f"round {r + 1} {name}: {results[name][-1][0]:.0f} req/s", file=sys.stderr)

    def cell(values, fmt):
        return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"

    direct = statistics.median(v[0] for v in results["direct"])
    direct_p99 = statistics.median(v[2] for v in results["direct"])
    print(f"\nwrk -t2 -c{CONNS} -d{SECONDS}s, {ROUNDS} rounds interleaved; median (min–max)\n")
    print("| target | req/s | % of direct | p50 ms | p99 ms | p99 added ms | sluice CPU % |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, _, _ in targets:
        rows = results[name]
        rps = [v[0] for v in rows]
        p99 = statistics.median(v[2] for v in rows)
        added = "–" if name == "direct" else f"{p99 - direct_p99:.2f}"
        print(
            f"| {name} | {cell(rps, '{:.0f}')} | {statistics.median(rps) / direct * 100:.0f}% "
            f"| {cell([v[1] for v in rows], '{:.2f}')} | {cell([v[2] for v in rows], '{:.2f}')} "
            f"| {added} | {statistics.median(cpu[name]):.0f} |"
        )
    print(f"\nsluice RSS after the run: {rss_kib(sluice.pid) / 1024:.1f} MiB")


try:
    main()
finally:
    procs.stop_all()
    shutil.rmtree(work, ignore_errors=True)

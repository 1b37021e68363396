"""Runs the pass-through benchmark (see passthrough.sh) and prints a Markdown table.

Targets are interleaved (A B C A B C ...) so that noise from the shared machine spreads
over all of them; each figure is the median of the rounds with the min-max beside it.
"""

import os
import shutil
import statistics
import sys
import tempfile
import time

from common import (
    Procs,
    absolute_form_script,
    cpu_seconds,
    hello_nginx,
    passthrough_config,
    rss_kib,
    start_sluice,
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


def settle(p):
    """Waits until the reader of `p`'s stderr has caught up, so that the next target is
    not measured while this one's log lines are still being read."""
    last = -1
    while p.log_lines[0] != last:
        last = p.log_lines[0]
        time.sleep(0.5)


def main():
    hello_nginx(procs, work, [NGINX_PORT, NGINX_PORT_MATCHED])
    # Two instances, measured in the same run: as shipped (an access line per request,
    # stderr read through a pipe) and with the access log off (RUST_LOG=warn).
    instances = {}
    for log, port, admin in [("shipped", PROXY_PORT, ADMIN_PORT), ("off", PROXY_PORT + 1, ADMIN_PORT + 1)]:
        conf_dir = os.path.join(work, log)
        os.makedirs(conf_dir)
        conf = passthrough_config(conf_dir, port, admin, NGINX_PORT_MATCHED)
        instances[log] = (start_sluice(procs, conf, log), port)
        wait_http(f"http://127.0.0.1:{admin}/readyz")
    wait_http(f"http://127.0.0.1:{NGINX_PORT_MATCHED}/")
    procs.check_alive()

    scripts = {
        "unmatched": absolute_form_script(work, NGINX_PORT),
        "matched": absolute_form_script(work, NGINX_PORT_MATCHED),
    }

    targets = [("direct", f"http://127.0.0.1:{NGINX_PORT}/", None, None)]
    for log, label in [("shipped", "as shipped (access log to a pipe)"), ("off", "access log off")]:
        p, port = instances[log]
        targets += [
            (f"sluice {label}, unmatched host", f"http://127.0.0.1:{port}", scripts["unmatched"], p),
            (f"sluice {label}, matched upstream + family", f"http://127.0.0.1:{port}", scripts["matched"], p),
        ]
    results = {t[0]: [] for t in targets}
    cpu = {t[0]: [] for t in targets}
    for _, url, script, p in targets[1:]:
        wrk(url, CONNS, 2, script)  # warm the pools and the page cache
    for r in range(ROUNDS):
        for name, url, script, p in targets:
            pids = [p.pid] if p else []
            before = cpu_seconds(pids)
            results[name].append(wrk(url, CONNS, SECONDS, script))
            cpu[name].append((cpu_seconds(pids) - before) / SECONDS * 100)
            settle(instances["shipped"][0])
            print(f"round {r + 1} {name}: {results[name][-1][0]:.0f} req/s", file=sys.stderr)

    def cell(values, fmt):
        return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"

    direct = statistics.median(v[0] for v in results["direct"])
    direct_p99 = statistics.median(v[2] for v in results["direct"])
    print(f"\nwrk -t2 -c{CONNS} -d{SECONDS}s, {ROUNDS} rounds interleaved; median (min–max)\n")
    print("| target | req/s | % of direct | p50 ms | p99 ms | p99 added ms | sluice CPU % |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, _, _, _ in targets:
        rows = results[name]
        rps = [v[0] for v in rows]
        p99 = statistics.median(v[2] for v in rows)
        added = "–" if name == "direct" else f"{p99 - direct_p99:.2f}"
        print(
            f"| {name} | {cell(rps, '{:.0f}')} | {statistics.median(rps) / direct * 100:.0f}% "
            f"| {cell([v[1] for v in rows], '{:.2f}')} | {cell([v[2] for v in rows], '{:.2f}')} "
            f"| {added} | {statistics.median(cpu[name]):.0f} |"
        )
    shipped, off = instances["shipped"][0], instances["off"][0]
    ratio = [
        statistics.median(v[0] for v in results[f"sluice as shipped (access log to a pipe), {k}"])
        / statistics.median(v[0] for v in results[f"sluice access log off, {k}"]) * 100
        for k in ["unmatched host", "matched upstream + family"]
    ]
    print(f"\nas shipped / log off: {ratio[0]:.0f}% unmatched, {ratio[1]:.0f}% matched; "
          f"{shipped.log_lines[0]} log lines read from the shipped instance's pipe")
    print(f"sluice RSS after the run: shipped {rss_kib(shipped.pid) / 1024:.1f} MiB, "
          f"log off {rss_kib(off.pid) / 1024:.1f} MiB")


try:
    main()
finally:
    procs.stop_all()
    shutil.rmtree(work, ignore_errors=True)

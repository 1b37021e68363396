"""What the status page costs: wrk through sluice as shipped (bundled config, an access
line per request read through a pipe) with nobody watching, and with the page open (a
client reading /status.json once a second, as the page does), interleaved; then the
feed's size and build time once thousands of partitions are live.

Loopback only; every process is started here and stopped by PID.
Usage: bench/status_page.sh [rounds=3] [seconds=8]
"""

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from common import (Procs, absolute_form_script, hello_nginx, shipped_config, start_sluice,
                    wait_http, wrk)

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
SECONDS = int(sys.argv[2]) if len(sys.argv) > 2 else 8
UP, LISTEN, ADMIN = 18480, 13148, 19948
work = tempfile.mkdtemp(prefix="sluice-status-")
procs = Procs()


def watcher(stop, times):
    """Reads the feed once a second, as an open page does."""
    while not stop.is_set():
        t0 = time.monotonic()
        urllib.request.urlopen(f"http://127.0.0.1:{ADMIN}/status.json", timeout=5).read()
        times.append(time.monotonic() - t0)
        stop.wait(max(0.0, 1.0 - (time.monotonic() - t0)))


def main():
    hello_nginx(procs, work, [UP])
    config = shipped_config(work, "sluice.toml", LISTEN, ADMIN)
    # A keyed upstream for the partitions part; the bundled config's own are untouched.
    with open(config, "a") as f:
        f.write(f'\n[[upstream]]\nname = "keyed"\nhosts = ["127.0.0.1:{UP}"]\n'
                'key = "header:Authorization"\n'
                # Generous: what is measured is paying it, not waiting.
                'limits = [{ kind = "token_bucket", rate = 100000000, per = "1s", '
                'burst = 100000000 }]\n')
    start_sluice(procs, config)
    wait_http(f"http://127.0.0.1:{ADMIN}/readyz")
    wait_http(f"http://127.0.0.1:{UP}/")
    script = absolute_form_script(work, UP)
    results = {"nobody watching": [], "page open": []}
    feed_times = []
    for _ in range(ROUNDS):
        for name in results:
            stop = threading.Event()
            t = None
            if name == "page open":
                t = threading.Thread(target=watcher, args=(stop, feed_times))
                t.start()
            results[name].append(wrk(f"http://127.0.0.1:{LISTEN}", 32, SECONDS, script))
            stop.set()
            if t:
                t.join()
    print(f"\nwrk -t2 -c32 -d{SECONDS}s through the keyed upstream's host, {ROUNDS} rounds "
          "interleaved; median (min–max)\n")
    print("| status page | req/s | p50 ms | p99 ms |")
    print("| --- | --- | --- | --- |")
    for name, rows in results.items():
        def cell(i, fmt):
            v = [r[i] for r in rows]
            return f"{fmt.format(statistics.median(v))} ({fmt.format(min(v))}–{fmt.format(max(v))})"
        print(f"| {name} | {cell(0, '{:.0f}')} | {cell(1, '{:.2f}')} | {cell(2, '{:.2f}')} |")

    # Thousands of partitions: a new Authorization value per request.
    keys = os.path.join(work, "keys.lua")
    with open(keys, "w") as f:
        f.write(f"""
local n = 0
function request()
  n = n + 1
  return wrk.format("GET", "http://127.0.0.1:{UP}/", {{["Host"] = "127.0.0.1:{UP}", ["Authorization"] = "Bearer k" .. n}})
end
""")
    out = subprocess.run(["wrk", "-t1", "-c4", "-d2s", "-s", keys, f"http://127.0.0.1:{LISTEN}"],
                         capture_output=True, text=True, check=True).stdout
    sent = int(re.search(r"(\d+) requests in", out).group(1))
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{ADMIN}/metrics").read().decode()
    sizes, builds = [], []
    for _ in range(5):
        t0 = time.monotonic()
        body = urllib.request.urlopen(f"http://127.0.0.1:{ADMIN}/status.json").read()
        builds.append((time.monotonic() - t0) * 1000)
        sizes.append(len(body))
        time.sleep(0.2)
    buckets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{ADMIN}/buckets").read())
    live = sum(1 for b in buckets if b["family"] is None)
    print(f"\nAfter {sent} requests with as many keys, with {live} live partitions: /status.json is {statistics.median(sizes) / 1024:.1f} KiB, "
          f"answered in {statistics.median(builds):.1f} ms (median of 5); during the rounds above "
          f"it took {statistics.median(feed_times) * 1000:.1f} ms (median of {len(feed_times)}).")
    m = re.search(r"^sluice_partitions (\d+)", metrics, re.M)
    if m:
        print(f"(sluice_partitions at the last sweep: {m.group(1)})")


try:
    main()
finally:
    procs.stop_all()
    shutil.rmtree(work, ignore_errors=True)

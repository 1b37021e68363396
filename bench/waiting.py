"""Measures sluice's memory while many requests wait, and with many partition keys.

1. 10k client connections each send one request to a bucket that admits one per hour;
   RSS is read before and once all 10k are queued (sluice_queue_depth), then after the
   clients hang up.
2. wrk sends requests with a new Authorization value each time for a few seconds
   (~100k keys) to an upstream keyed by that header; RSS and sluice_partitions are read
   right after, and again once the idle sweep has dropped the partitions.
"""

import asyncio
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from common import SLUICE, Procs, get, rss_kib, stalling_upstream, wait_http

NGINX_PORT, PROXY_PORT, ADMIN_PORT = 18090, 13138, 19911
QUEUED = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
work = tempfile.mkdtemp(prefix="sluice-wait-")
procs = Procs()


def metric(name):
    text = get(f"http://127.0.0.1:{ADMIN_PORT}/metrics")
    m = re.search(rf"^{re.escape(name)} (\d+)", text, re.M)
    return int(m.group(1)) if m else 0


def sluice(config):
    path = os.path.join(work, "sluice.toml")
    with open(path, "w") as f:
        f.write(f'[proxy]\nlisten = "127.0.0.1:{PROXY_PORT}"\nadmin = "127.0.0.1:{ADMIN_PORT}"\n'
                f'drain_timeout = "1s"\n{config}\n'
                # Unmatched targets on loopback, which the egress rules refuse unless allowed.
                '[egress]\nallow = ["127.0.0.1"]\n')
    p = procs.start([SLUICE, "run", "-c", path], env={**os.environ, "RUST_LOG": "warn"})
    wait_http(f"http://127.0.0.1:{ADMIN_PORT}/readyz")
    return p


async def hold_queued(n):
    request = f"GET http://127.0.0.1:{NGINX_PORT + 1}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    conns = []
    for i in range(n):
        _, w = await asyncio.open_connection("127.0.0.1", PROXY_PORT)
        w.write(request)
        conns.append(w)
        if i % 500 == 0:
            await asyncio.sleep(0)
    return conns


async def queued_run():
    # An upstream that accepts and never answers: the first request holds the only
    # concurrency permit, so every later one waits in sluice's queue.
    stall = await stalling_upstream(NGINX_PORT + 1)
    p = sluice(f"""
[[upstream]]
name = "slow"
hosts = ["127.0.0.1:{NGINX_PORT + 1}"]
max_queue = 100000
max_wait = "1h"
total_timeout = "2h"
attempt_timeout = "2h"
limits = [{{ kind = "concurrency", max = 1 }}]
""")
    _, holder = await asyncio.open_connection("127.0.0.1", PROXY_PORT)
    holder.write(f"GET http://127.0.0.1:{NGINX_PORT + 1}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await asyncio.sleep(0.5)
    before = rss_kib(p.pid)
    conns = await hold_queued(QUEUED)
    depth_name = 'sluice_queue_depth{family="-",upstream="slow"}'
    for _ in range(600):
        if metric(depth_name) >= QUEUED:
            break
        await asyncio.sleep(0.1)
    depth = metric(depth_name)
    during = rss_kib(p.pid)
    for w in conns:
        w.close()
    for _ in range(600):
        if metric(depth_name) == 0:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1)
    after = rss_kib(p.pid)
    holder.close()
    stall.close()
    procs.stop(p)
    per = (during - before) * 1024 / max(depth, 1)
    print(f"| {depth} requests queued on one bucket | {before / 1024:.1f} MiB | {during / 1024:.1f} MiB "
          f"| {per / 1024:.1f} KiB per queued request | {after / 1024:.1f} MiB after clients left |")


def keys_run():
    p = sluice(f"""
[[upstream]]
name = "keyed"
hosts = ["127.0.0.1:{NGINX_PORT}"]
key = "header:Authorization"
limits = [{{ kind = "sliding_window", permits = 1000, window = "2s" }}]
""")
    script = os.path.join(work, "keys.lua")
    with open(script, "w") as f:
        f.write(f"""
local n = 0
local id = 0
function setup(thread) thread:set("tid", id); id = id + 1 end
function request()
  n = n + 1
  return wrk.format("GET", "http://127.0.0.1:{NGINX_PORT}/", {{["Authorization"] = "Bearer key-" .. tid .. "-" .. n}})
end
""")
    before = rss_kib(p.pid)
    out = subprocess.run(["wrk", "-t2", "-c32", "-d4s", "-s", script, f"http://127.0.0.1:{PROXY_PORT}"],
                         capture_output=True, text=True, check=True).stdout
    sent = int(re.search(r"(\d+) requests in", out).group(1))
    time.sleep(5.5)  # one sweep while the windows are still live
    peak = rss_kib(p.pid)
    live = metric("sluice_partitions")
    time.sleep(8)  # windows empty, next sweep drops them
    after = rss_kib(p.pid)
    gone = metric("sluice_partitions")
    procs.stop(p)
    print(f"| {sent} distinct keys | {before / 1024:.1f} MiB | {peak / 1024:.1f} MiB with {live} partitions "
          f"| {(peak - before) * 1024 / max(live, 1):.0f} B per partition "
          f"| {after / 1024:.1f} MiB with {gone} partitions after the sweep |")


def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < QUEUED + 100:
        raise SystemExit(f"open-file limit {hard} is too low for {QUEUED} connections")
    conf = os.path.join(work, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"""worker_processes 1; daemon off; pid {work}/nginx.pid; error_log {work}/error.log;
events {{ worker_connections 4096; }}
http {{ access_log off; server {{ listen 127.0.0.1:{NGINX_PORT}; location / {{ return 200 "ok\\n"; }} }} }}
""")
    procs.start(["nginx", "-c", conf, "-p", work])
    wait_http(f"http://127.0.0.1:{NGINX_PORT}/")
    print("| load | RSS before | RSS under load | per unit | afterwards |")
    print("| --- | --- | --- | --- | --- |")
    asyncio.run(queued_run())
    keys_run()


try:
    main()
finally:
    procs.stop_all()
    shutil.rmtree(work, ignore_errors=True)

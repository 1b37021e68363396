"""A flood of made-up partition keys: sluice's memory, and the latency of other requests.

sluice runs as users run it (default log level, stderr read through a pipe) with two
upstreams on one nginx: `keyed`, keyed by Authorization with a fixed window of 300 per
minute (the bundled config's shape), and `steady`, unkeyed and unlimited. A probe
(wrk -t1 -c1) sends requests to `steady` throughout, and a watcher reads /status.json
and /buckets in a loop, as anyone who reaches the admin port can. Phases, each with the
probe running:

1. quiet: the probe alone.
2. same key: a flood (wrk -t1 -c16) to `keyed` with one Authorization value; past the
   window's 300 those requests are refused at once (429 queue_timeout).
3. new keys: the same flood with a new value in every request, until KEYS values have
   been sent: with the default max_partitions, and again with max_partitions = KEYS,
   where every value gets a partition.

RSS is sampled every 0.2 s; the partitions are read from /metrics.
Usage: partitions.py [KEYS]
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from common import Procs, _ms, rss_kib, start_sluice, wait_http

NGINX, PROXY, ADMIN = 18190, 13238, 19931
KEYS = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
work = tempfile.mkdtemp(prefix="sluice-partitions-")
procs = Procs()


def config(max_partitions):
    cap = f"max_partitions = {max_partitions}\n" if max_partitions else ""
    path = os.path.join(work, "sluice.toml")
    with open(path, "w") as f:
        f.write(f"""[proxy]
listen = "127.0.0.1:{PROXY}"
admin = "127.0.0.1:{ADMIN}"
drain_timeout = "1s"

[[upstream]]
name = "keyed"
hosts = ["127.0.0.1:{NGINX}"]
key = "header:Authorization"
max_wait = "1ms"
{cap}limits = [{{ kind = "fixed_window", permits = 300, window = "1m" }}]

[[upstream]]
name = "steady"
hosts = ["127.0.0.1:{NGINX + 1}"]

[egress]
allow = ["127.0.0.1"]
""")
    return path


def script(name, body):
    path = os.path.join(work, name)
    with open(path, "w") as f:
        f.write(body)
    return path


def flood_script(new_keys):
    key = '"Bearer key-" .. tid .. "-" .. n' if new_keys else '"Bearer the-one-key"'
    return script(f"flood-{new_keys}.lua", f"""
local n = 0
local id = 0
function setup(thread) thread:set("tid", id); id = id + 1 end
function request()
  n = n + 1
  return wrk.format("GET", "http://127.0.0.1:{NGINX}/", {{["Host"] = "127.0.0.1:{NGINX}", ["Authorization"] = {key}}})
end
""")


def probe_script():
    return script("probe.lua", f'wrk.path = "http://127.0.0.1:{NGINX + 1}/"\n'
                               f'wrk.headers["Host"] = "127.0.0.1:{NGINX + 1}"\n')


def run_wrk(args, seconds):
    cmd = ["wrk", *args, f"-d{seconds}s", "--latency", f"http://127.0.0.1:{PROXY}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def latency(out, ok=True):
    """(p50 ms, p99 ms, requests) of a wrk run; with `ok`, any non-2xx answer aborts."""
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if ok and bad:
        raise SystemExit(f"{bad.group(1)} non-2xx answers\n{out}")
    lat = {p: _ms(v, u) for p, v, u in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)", out, re.M)}
    sent = int(re.search(r"(\d+) requests in", out).group(1))
    return lat["50"], lat["99"], sent


class Sampler:
    """RSS every 0.2 s, and /status.json and /buckets read back to back by one client."""

    def __init__(self, pid):
        self.pid, self.stop = pid, threading.Event()
        self.rss, self.status_ms, self.buckets_ms = [], [], []
        self.threads = [threading.Thread(target=self.sample_rss), threading.Thread(target=self.watch)]
        for t in self.threads:
            t.start()

    def sample_rss(self):
        while not self.stop.wait(0.2):
            self.rss.append(rss_kib(self.pid))

    def watch(self):
        while not self.stop.is_set():
            for path, into in (("/status.json", self.status_ms), ("/buckets", self.buckets_ms)):
                t = time.monotonic()
                urllib.request.urlopen(f"http://127.0.0.1:{ADMIN}{path}", timeout=30).read()
                into.append((time.monotonic() - t) * 1000)

    def end(self):
        self.stop.set()
        for t in self.threads:
            t.join()


def metric(name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{ADMIN}/metrics", timeout=30).read().decode()
    m = re.search(rf"^{re.escape(name)} (\d+)", text, re.M)
    return int(m.group(1)) if m else 0


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def keyed_answered():
    text = urllib.request.urlopen(f"http://127.0.0.1:{ADMIN}/metrics", timeout=30).read().decode()
    return sum(int(float(v)) for v in re.findall(r'^sluice_requests_total\{[^}]*upstream="keyed"\} (\S+)', text, re.M))


def phase(p, name, flood, seconds, until=None):
    """The probe for as long as the flood runs (`seconds`, or until sluice has answered
    `until` requests to `keyed`), then the counts after one more sweep."""
    sampler = Sampler(p.pid)
    started = time.monotonic()
    probe = run_wrk(["-t1", "-c1", "-s", probe_script()], seconds)
    sent = 0
    if flood:
        load = run_wrk(["-t1", "-c16", "-s", flood], seconds)
        # wrk runs for its whole -d; it stops and reports on SIGINT, sent once sluice
        # has answered `until` requests to `keyed`.
        if until:
            until += keyed_answered()
            while load.poll() is None and keyed_answered() < until:
                time.sleep(0.2)
            for w in (load, probe):
                w.send_signal(signal.SIGINT)
        sent = latency(load.communicate()[0], ok=False)[2]
    p50, p99, _ = latency(probe.communicate()[0])
    took = time.monotonic() - started
    time.sleep(6)  # past 1,024 partitions the metrics are as of the last sweep
    sampler.end()
    live = metric('sluice_upstream_partitions{upstream="keyed"}')
    refused = metric('sluice_rejections_total{family="-",reason="partition_limit",upstream="keyed"}')
    peak = max(sampler.rss) / 1024
    print(f"| {name}, {took:.0f} s | {sent} | {live} | {refused} | {peak:.1f} MiB | {sampler.rss[-1] / 1024:.1f} MiB "
          f"| {p50:.2f} / {p99:.2f} | {median(sampler.status_ms):.1f} / {max(sampler.status_ms):.1f} "
          f"| {median(sampler.buckets_ms):.1f} / {max(sampler.buckets_ms):.1f} |", flush=True)
    return sent


def run(cap):
    p = start_sluice(procs, config(cap))
    wait_http(f"http://127.0.0.1:{ADMIN}/readyz")
    label = f"max_partitions = {cap}" if cap else "default max_partitions"
    if not cap:
        phase(p, "quiet", None, 10)
        phase(p, "same key", flood_script(False), 10)
    phase(p, f"new keys, {label}", flood_script(True), 600, until=KEYS)
    procs.stop(p)


def main():
    conf = os.path.join(work, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"""worker_processes 1; daemon off; pid {work}/nginx.pid; error_log {work}/error.log;
events {{ worker_connections 4096; }}
http {{ access_log off;
  server {{ listen 127.0.0.1:{NGINX}; listen 127.0.0.1:{NGINX + 1}; location / {{ return 200 "ok\\n"; }} }} }}
""")
    procs.start(["nginx", "-c", conf, "-p", work])
    wait_http(f"http://127.0.0.1:{NGINX}/")
    print("| phase | flood requests | partitions after | refused partition_limit | peak RSS | RSS at end "
          "| probe p50 / p99 ms | /status.json median / max ms | /buckets median / max ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    run(None)
    run(KEYS)


try:
    main()
finally:
    procs.stop_all()
    shutil.rmtree(work, ignore_errors=True)

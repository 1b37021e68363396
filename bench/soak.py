"""A soak under chaos: the release build as shipped (default log level, stderr read
through a pipe), mixed traffic to four upstreams for minutes, with reloads that lower and
raise the limits, two Redis outages, an upstream down for 30 s, and SIGTERM under load at
the end. Records sluice's RSS and open descriptors every 5 s, and every arrival at every
upstream, then checks the limits as the upstreams saw them: in any window that lies
wholly inside one config, no more arrivals than that config's limit.

Usage: bench/soak.sh [SECONDS=600] [CLIENTS=60]. Loopback only; every process is
started here and stopped by PID.
"""

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from common import Procs, rss_kib, start_sluice, wait_http

SECONDS = int(sys.argv[1]) if len(sys.argv) > 1 else 600
CLIENTS = int(sys.argv[2]) if len(sys.argv) > 2 else 60
PROXY, ADMIN, REDIS = 13201, 19931, 16391
UPSTREAMS = {"orders": 18201, "catalog": 18202, "slow": 18203, "shared": 18204}
work = tempfile.mkdtemp(prefix="sluice-soak-")
procs = Procs()
random.seed(int(os.environ.get("BENCH_SEED", "7")))

# Two configs the reloads alternate between: each upstream's limit in each.
LIMITS = [
    {"orders": (20, 1.0), "catalog": (30, 1.0), "shared": (25, 1.0), "slow": 4},
    {"orders": (8, 1.0), "catalog": (12, 1.0), "shared": (10, 1.0), "slow": 2},
]


def config(n):
    l = LIMITS[n]
    return f"""[proxy]
listen = "127.0.0.1:{PROXY}"
admin = "127.0.0.1:{ADMIN}"
drain_timeout = "10s"
[egress]
allow = ["127.0.0.0/8"]
[defaults]
max_queue = 2000
max_wait = "20s"
attempt_timeout = "5s"
total_timeout = "30s"
[[upstream]]
name = "orders"
hosts = ["127.0.0.1:{UPSTREAMS['orders']}"]
limits = [{{ kind = "sliding_window", permits = {l['orders'][0]}, window = "1s" }}]
  [[upstream.family]]
  name = "writes"
  methods = ["POST"]
  paths = ["/v1/orders/**"]
[[upstream]]
name = "catalog"
hosts = ["127.0.0.1:{UPSTREAMS['catalog']}"]
key = "header:Authorization"
limits = [{{ kind = "sliding_window", permits = {l['catalog'][0]}, window = "1s" }}]
[[upstream]]
name = "slow"
hosts = ["127.0.0.1:{UPSTREAMS['slow']}"]
limits = [{{ kind = "concurrency", max = {l['slow']} }}]
[[upstream]]
name = "shared"
hosts = ["127.0.0.1:{UPSTREAMS['shared']}"]
limits = [{{ kind = "sliding_window", permits = {l['shared'][0]}, window = "1s", scope = "global" }}]
[cluster]
redis = "redis://127.0.0.1:{REDIS}/0"
on_redis_error = "local"
replicas = 1
"""


class Upstream:
    """A keep-alive HTTP/1.1 server that stamps every request's arrival; `/slow/MS`
    answers after MS, a few requests get 429, and `down` closes the listener."""

    def __init__(self, name, port):
        self.name, self.port = name, port
        self.arrivals = []
        self.server = None
        self.in_flight = 0
        self.max_in_flight = 0
        self.writers = set()

    async def start(self):
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", self.port)

    async def stop(self):
        """Down: no new connection, and those open are cut."""
        self.server.close()
        for w in list(self.writers):
            w.transport.abort()
        await self.server.wait_closed()

    async def serve(self, reader, writer):
        self.writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                key = re.search(rb"authorization: *([^\r]+)", head, re.I)
                self.arrivals.append((time.monotonic(), key.group(1) if key else b""))
                line = head.split(b"\r\n", 1)[0].decode()
                m = re.search(rb"content-length: *(\d+)", head, re.I)
                if m:
                    await reader.readexactly(int(m.group(1)))
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    slow = re.search(r"/slow/(\d+)", line)
                    if slow:
                        await asyncio.sleep(int(slow.group(1)) / 1000)
                finally:
                    self.in_flight -= 1
                status = "429 Too Many Requests" if random.random() < 0.01 else "200 OK"
                writer.write(f"HTTP/1.1 {status}\r\nContent-Length: 2\r\n"
                             "Retry-After: 1\r\n\r\nok".encode())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()


async def client(i, stop, outcomes, pending):
    """Closed-loop requests through sluice on one keep-alive connection, reopened
    whenever sluice closes it."""
    rng = random.Random(i)
    reader = writer = None
    while time.monotonic() < stop:
        name = rng.choice(["orders", "orders", "catalog", "catalog", "slow", "shared"])
        port = UPSTREAMS[name]
        if name == "orders" and rng.random() < 0.3:
            req = (f"POST http://127.0.0.1:{port}/v1/orders/{i} HTTP/1.1\r\n"
                   f"Host: 127.0.0.1:{port}\r\nIdempotency-Key: {i}-{rng.random()}\r\n"
                   "Content-Length: 5\r\n\r\nhello")
        elif name == "slow":
            req = (f"GET http://127.0.0.1:{port}/slow/{rng.choice([50, 200, 800])} HTTP/1.1\r\n"
                   f"Host: 127.0.0.1:{port}\r\n\r\n")
        else:
            key = f"Authorization: Bearer tenant-{rng.randrange(20)}\r\n" if name == "catalog" else ""
            req = (f"GET http://127.0.0.1:{port}/v1/items HTTP/1.1\r\n"
                   f"Host: 127.0.0.1:{port}\r\n{key}\r\n")
        pending[i] = time.monotonic()
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", PROXY)
            writer.write(req.encode())
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
            status = head[9:12].decode()
            m = re.search(rb"content-length: *(\d+)", head, re.I)
            if m:
                await reader.readexactly(int(m.group(1)))
            reason = re.search(rb"sluice-reason: *([a-z_]+)", head, re.I)
            key = status + ("/" + reason.group(1).decode() if reason else "")
            outcomes[key] = outcomes.get(key, 0) + 1
            if b"connection: close" in head.lower():
                writer.close()
                writer = None
        except asyncio.TimeoutError:
            outcomes["hung"] = outcomes.get("hung", 0) + 1
            writer = None
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            outcomes["closed"] = outcomes.get("closed", 0) + 1
            writer = None
            await asyncio.sleep(0.05)
        pending.pop(i, None)


def redis_up():
    return subprocess.Popen(["redis-server", "--port", str(REDIS), "--save", "",
                             "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def violations(arrivals, changes, name, end):
    """Arrivals beyond the limit in force, counted in windows that lie wholly inside one
    config (after each reload, the limit it set; before the first, the starting one)."""
    window = LIMITS[0][name][1]
    over = worst = 0
    first = 0  # the earliest arrival inside the window ending at arrival i
    c = 0  # the config change in force at arrival i
    for i, t in enumerate(arrivals):
        while arrivals[first] <= t - window:
            first += 1
        while c + 1 < len(changes) and changes[c + 1][0] <= t:
            c += 1
        since, n = changes[c]
        if t - window < since or t > end:
            continue
        count = i - first + 1
        permits = LIMITS[n][name][0]
        worst = max(worst, count - permits)
        over += count > permits
    return over, worst


def reload():
    req = urllib.request.Request(f"http://127.0.0.1:{ADMIN}/reload", method="POST")
    return urllib.request.urlopen(req, timeout=10).status


async def main():
    redis = redis_up()
    time.sleep(0.3)
    ups = {n: Upstream(n, p) for n, p in UPSTREAMS.items()}
    for u in ups.values():
        await u.start()
    path = os.path.join(work, "sluice.toml")
    open(path, "w").write(config(0))
    sluice = start_sluice(procs, path)
    wait_http(f"http://127.0.0.1:{ADMIN}/readyz")
    t0 = time.monotonic()
    stop = t0 + SECONDS
    outcomes, pending, samples = {}, {}, []
    changes = [(t0, 0)]
    tasks = [asyncio.create_task(client(i, stop, outcomes, pending)) for i in range(CLIENTS)]
    events = []
    n, next_reload = 0, t0 + 20
    outage = [(0.25, 0.32), (0.60, 0.64)]
    down_at = t0 + 0.45 * SECONDS
    while time.monotonic() < stop:
        now = time.monotonic()
        frac = (now - t0) / SECONDS
        if now >= next_reload:
            n = 1 - n
            open(path + ".new", "w").write(config(n))
            os.replace(path + ".new", path)
            # Applied at once (the watcher would take its debounce): the config is in
            # force from when the answer comes.
            reload()
            changes.append((time.monotonic(), n))
            events.append((round(now - t0, 1), f"reload to config {n}"))
            next_reload = now + SECONDS / 22
        for a, b in outage:
            if a <= frac < b and redis is not None:
                redis.kill()
                redis.wait()
                redis = None
                events.append((round(now - t0, 1), "Redis down"))
            if b <= frac < b + 0.02 and redis is None:
                redis = redis_up()
                events.append((round(now - t0, 1), "Redis up"))
        if down_at <= now < down_at + 30 and ups["slow"].server.is_serving():
            await ups["slow"].stop()
            events.append((round(now - t0, 1), "upstream slow down"))
        if now >= down_at + 30 and not ups["slow"].server.is_serving():
            await ups["slow"].start()
            events.append((round(now - t0, 1), "upstream slow up"))
        samples.append((round(now - t0), rss_kib(sluice.pid), fds(sluice.pid)))
        await asyncio.sleep(5)
    # SIGTERM under load: every client still in a request must get an answer or a close.
    term_at = time.monotonic()
    sluice.send_signal(signal.SIGTERM)
    code = await asyncio.get_running_loop().run_in_executor(None, sluice.wait, 40)
    took = time.monotonic() - term_at
    await asyncio.sleep(1)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if redis is not None:
        redis.kill()
    end = term_at
    report = {
        "seconds": SECONDS,
        "clients": CLIENTS,
        "requests_answered": sum(v for k, v in outcomes.items() if k[0].isdigit()),
        "outcomes": dict(sorted(outcomes.items())),
        "hung": outcomes.get("hung", 0),
        "exit_code": code,
        "shutdown_seconds": round(took, 1),
        "rss_mib_min_max_after_minute_1": [
            round(min(r for t, r, _ in samples if t >= 60) / 1024, 1),
            round(max(r for t, r, _ in samples if t >= 60) / 1024, 1),
        ] if any(t >= 60 for t, _, _ in samples) else None,
        "fds_min_max": [min(f for _, _, f in samples), max(f for _, _, f in samples)],
        "arrivals": {n: len(u.arrivals) for n, u in ups.items()},
        "slow_max_in_flight": ups["slow"].max_in_flight,
        "slow_limit_max": max(l["slow"] for l in LIMITS),
        # Per partition: catalog's limit is per API key.
        "over_limit": {n: [sum(x) for x in zip(*(
            violations(sorted(t for t, k in u.arrivals if k == key), changes, n, end)
            for key in {k for _, k in u.arrivals}))]
            for n, u in ups.items() if n != "slow"},
        "partitions": {n: len({k for _, k in u.arrivals}) for n, u in ups.items()},
        "events": events,
    }
    print(json.dumps(report, indent=1))
    procs.stop_all()


try:
    asyncio.run(main())
finally:
    procs.stop_all()

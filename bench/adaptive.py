"""Limits that follow the provider, and fairness between tenants (docs/adaptive.md).

1. adaptive: a provider whose real limit is 30% below the configured one (21 per 2 s
   against 30 per 2 s), answering a bare 429 beyond it; four clients flood sluice for
   SECONDS, once with the static config and once with `adaptive = {}`, side by side.
   Reports accepted and refused (429) requests per minute at the provider.
2. learn: a provider of 30 per 2 s that announces `RateLimit: "default";r=..;t=..` while
   a hidden client spends 20 of each window; static against `learn = "headers"`.
3. fairness: a bulk tenant keeps 5,000 requests queued on a family at 100/s while an
   interactive tenant sends one request a second for 30 s; the interactive requests'
   wait (sluice-queue-wait) p50/p99/max with the family's queue FIFO and with
   `tenant = "header:X-Tenant"`.

Every process is started here on loopback and stopped by PID. Usage:
bench/adaptive.sh [seconds=60]
"""

import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time

from common import Procs, start_sluice as start_shipped, wait_http

SECONDS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
work = tempfile.mkdtemp(prefix="sluice-adaptive-")
procs = Procs()
PORT = 18300  # providers from here up, sluice listeners from PORT + 100, admin PORT + 200


class Provider:
    """A fixed window of `permits` per `window` seconds on its own clock; a hidden client
    spends `hidden` at the start of each window; `announce` adds the draft's RateLimit
    field. Counts accepted and refused requests."""

    def __init__(self, port, permits, window, hidden=0, announce=False, permit_all=False):
        self.port, self.permits, self.window = port, permits, window
        self.hidden, self.announce, self.permit_all = hidden, announce, permit_all
        self.start = time.monotonic()
        self.count = hidden
        self.accepted = self.refused = 0

    def decide(self):
        now = time.monotonic()
        while now >= self.start + self.window:
            self.start += self.window
            self.count = self.hidden
        ok = self.permit_all or self.count < self.permits
        if ok:
            self.count += 1
            self.accepted += 1
        else:
            self.refused += 1
        left = max(self.permits - self.count, 0)
        reset = max(int(-(-(self.start + self.window - now) // 1)), 1)
        return ok, left, reset

    async def serve(self):
        async def conn(reader, writer):
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    if not head:
                        return
                    ok, left, reset = self.decide()
                    status = "200 OK" if ok else "429 Too Many Requests"
                    extra = f'ratelimit: "default";r={left};t={reset}\r\n' if self.announce else ""
                    writer.write(f"HTTP/1.1 {status}\r\ncontent-length: 3\r\n{extra}\r\nok\n".encode())
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        return await asyncio.start_server(conn, "127.0.0.1", self.port, backlog=8192)


def start_sluice(name, port, admin, body):
    path = os.path.join(work, f"{name}.toml")
    with open(path, "w") as f:
        f.write(f'[proxy]\nlisten = "127.0.0.1:{port}"\nadmin = "127.0.0.1:{admin}"\n'
                f'drain_timeout = "1s"\nmax_connections = 20000\n{body}\n'
                '[egress]\nallow = ["127.0.0.1"]\n')
    # As users run it: the default log level, an access line per request read through
    # a pipe.
    p = start_shipped(procs, path)
    wait_http(f"http://127.0.0.1:{admin}/readyz")
    return p


async def exchange(reader, writer, target, headers=""):
    """One request through the proxy on an open connection: (status, queue wait ms)."""
    writer.write(f"GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n{headers}\r\n".encode())
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    status = int(head.split(" ", 2)[1])
    length, wait = 0, None
    for line in head.split("\r\n")[1:]:
        k, _, v = line.partition(":")
        if k.lower() == "content-length":
            length = int(v)
        elif k.lower() == "sluice-queue-wait":
            wait = int(v)
    await reader.readexactly(length)
    return status, wait


async def flood(proxy_port, target, seconds, clients=4):
    end = time.monotonic() + seconds

    async def one():
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
        while time.monotonic() < end:
            try:
                await asyncio.wait_for(exchange(reader, writer, target), end - time.monotonic() + 0.01)
            except asyncio.TimeoutError:
                break
        writer.close()

    await asyncio.gather(*(one() for _ in range(clients)))


async def side_by_side(title, body_static, body_other, other_name, provider_args):
    """Runs the static config and the other one at once, each against its own provider."""
    results = []
    servers = []
    names = [("static", body_static), (other_name, body_other)]
    runs = []
    for i, (name, body) in enumerate(names):
        provider = Provider(PORT + i, **provider_args)
        servers.append(await provider.serve())
        start_sluice(f"{title}-{name}", PORT + 100 + i, PORT + 200 + i,
                     body.format(port=PORT + i))
        runs.append((name, provider))
    await asyncio.gather(*(flood(PORT + 100 + i, f"127.0.0.1:{PORT + i}", SECONDS)
                           for i in range(len(names))))
    for s in servers:
        s.close()
    procs.stop_all()
    procs.started.clear()
    per_min = 60 / SECONDS
    for name, p in runs:
        results.append(f"| {title} | {name} | {p.accepted * per_min:.0f} | {p.refused * per_min:.0f} |")
    return results


async def fairness(fair):
    provider = Provider(PORT + 10, permits=1, window=1, permit_all=True)
    server = await provider.serve()
    target = f"127.0.0.1:{PORT + 10}"
    tenant = '\ntenant = "header:X-Tenant"' if fair else ""
    start_sluice("fair" if fair else "fifo", PORT + 110, PORT + 210, f"""
[[upstream]]
name = "shared"
hosts = ["{target}"]
max_queue = 6000
max_wait = "10m"
total_timeout = "20m"
limits = [{{ kind = "token_bucket", rate = 100, per = "1s", burst = 1 }}]
  [[upstream.family]]
  name = "jobs"{tenant}
""")
    bulk_done = asyncio.Event()

    async def bulk():
        reader, writer = await asyncio.open_connection("127.0.0.1", PORT + 110)
        try:
            while not bulk_done.is_set():
                await exchange(reader, writer, target, "X-Tenant: bulk\r\n")
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        writer.close()

    bulks = []
    for i in range(5000):
        bulks.append(asyncio.create_task(bulk()))
        if i % 250 == 0:
            await asyncio.sleep(0.05)
    await asyncio.sleep(3)

    async def interactive():
        reader, writer = await asyncio.open_connection("127.0.0.1", PORT + 110)
        status, wait = await exchange(reader, writer, target, "X-Tenant: ui\r\n")
        writer.close()
        return status, wait

    tasks = []
    for _ in range(30):
        tasks.append(asyncio.create_task(interactive()))
        await asyncio.sleep(1)
    got = await asyncio.gather(*tasks)
    bulk_done.set()
    for b in bulks:
        b.cancel()
    server.close()
    procs.stop_all()
    procs.started.clear()
    waits = sorted(w for s, w in got if s == 200 and w is not None)
    if not waits:
        return f"| {'tenants in turns' if fair else 'FIFO'} | no interactive request answered | | | |"
    p99 = waits[min(len(waits) - 1, int(len(waits) * 0.99))]
    return (f"| {'tenants in turns' if fair else 'FIFO'} | {len(waits)} of {len(got)} | "
            f"{statistics.median(waits)} | {p99} | {waits[-1]} |")


async def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 11000:
        raise SystemExit(f"open-file limit {hard} is too low for 5,000 queued connections")
    limits = 'limits = [{{ kind = "fixed_window", permits = 30, window = "2s" }}]\n'
    up = '[[upstream]]\nname = "p"\nhosts = ["127.0.0.1:{port}"]\nretry = {{ max_attempts = 1 }}\n'
    rows = []
    rows += await side_by_side("real limit 30% below the config", up + limits,
                               up + "adaptive = {{}}\n" + limits, "adaptive = {}",
                               dict(permits=21, window=2))
    rows += await side_by_side("key shared with a hidden client (20 of 30 per window)", up + limits,
                               up + 'learn = "headers"\n' + limits, 'learn = "headers"',
                               dict(permits=30, window=2, hidden=20, announce=True))
    print(f"\n{SECONDS} s each, four clients flooding, per minute at the provider:\n")
    print("| provider | sluice | accepted per minute | refused (429) per minute |")
    print("| --- | --- | --- | --- |")
    print("\n".join(rows))
    print("\nA bulk tenant keeping 5,000 requests queued at 100/s; an interactive tenant sends "
          "one request a second for 30 s; its sluice-queue-wait in ms:\n")
    print("| family queue | interactive answered | p50 | p99 | max |")
    print("| --- | --- | --- | --- | --- |")
    print(await fairness(False))
    print(await fairness(True))


try:
    asyncio.run(main())
finally:
    procs.stop_all()

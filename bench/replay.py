"""Measures sluice's memory with a queue full of large PUTs (the hardening review's
finding: bodies were read whole before queueing).

An upstream that accepts and never answers holds the only concurrency permit; N clients
then each send a PUT with a 1 MiB body (retryable, so eligible for a replay copy),
writing it in 64 KiB pieces as fast as sluice takes them. RSS is read before, and once
all N are queued and nothing has moved for two seconds. SLUICE_BIN=<older build>
measures that build instead.
"""

import asyncio
import os
import re
import sys
import tempfile

from common import SLUICE, Procs, get, rss_kib, stalling_upstream, wait_http

UP_PORT, PROXY_PORT, ADMIN_PORT = 18190, 13148, 19921
QUEUED = int(sys.argv[1]) if len(sys.argv) > 1 else 400
BODY = 1 << 20
work = tempfile.mkdtemp(prefix="sluice-replay-")
procs = Procs()


def metric(name):
    text = get(f"http://127.0.0.1:{ADMIN_PORT}/metrics")
    m = re.search(rf"^{re.escape(name)} (\d+)", text, re.M)
    return int(m.group(1)) if m else 0


async def put(sent):
    _, w = await asyncio.open_connection("127.0.0.1", PROXY_PORT)
    w.write(f"PUT http://127.0.0.1:{UP_PORT}/ HTTP/1.1\r\nHost: x\r\n"
            f"Content-Length: {BODY}\r\n\r\n".encode())
    piece = b"x" * 65536
    for _ in range(BODY // len(piece)):
        w.write(piece)
        await w.drain()
        sent[0] += len(piece)
    return w


async def main():
    stall = await stalling_upstream(UP_PORT)
    path = os.path.join(work, "sluice.toml")
    with open(path, "w") as f:
        f.write(f"""[proxy]
listen = "127.0.0.1:{PROXY_PORT}"
admin = "127.0.0.1:{ADMIN_PORT}"
drain_timeout = "1s"
[[upstream]]
name = "slow"
hosts = ["127.0.0.1:{UP_PORT}"]
max_queue = 100000
max_wait = "1h"
total_timeout = "2h"
attempt_timeout = "2h"
limits = [{{ kind = "concurrency", max = 1 }}]
""")
    p = procs.start([SLUICE, "run", "-c", path])
    wait_http(f"http://127.0.0.1:{ADMIN_PORT}/readyz")
    _, holder = await asyncio.open_connection("127.0.0.1", PROXY_PORT)
    holder.write(f"GET http://127.0.0.1:{UP_PORT}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await asyncio.sleep(0.5)
    before = rss_kib(p.pid)
    sent = [0]
    tasks = [asyncio.create_task(put(sent)) for _ in range(QUEUED)]
    depth_name = 'sluice_queue_depth{family="-",upstream="slow"}'
    for _ in range(600):
        if metric(depth_name) >= QUEUED:
            break
        await asyncio.sleep(0.1)
    # Until the clients can write no more (sluice reads nothing, or everything).
    last = -1
    while sent[0] != last:
        last = sent[0]
        await asyncio.sleep(2)
    depth = metric(depth_name)
    during = rss_kib(p.pid)
    for t in tasks:
        t.cancel()
    holder.close()
    stall.close()
    procs.stop(p)
    build = "SLUICE_BIN" if os.environ.get("SLUICE_BIN") else "this build"
    print(f"| {build} | {depth} PUTs of 1 MiB queued "
          f"| {before / 1024:.1f} MiB | {during / 1024:.1f} MiB "
          f"| {sent[0] / 2**20:.0f} MiB written by clients |")


try:
    asyncio.run(main())
finally:
    procs.stop_all()

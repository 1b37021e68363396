"""Memory per idle client connection (see idle.sh). For each proxy: RSS after a warm-up,
then N connections each send one request through it (sluice: absolute-form, as
HTTP_PROXY clients do; haproxy: origin-form), read the answer and stay open and silent;
RSS again once they are all idle. The difference over N is what an idle connection
costs, its upstream side included (sluice keeps the upstream connection a client
connection used for that client's next request; haproxy returns it to a shared idle
pool). Descriptors are counted from /proc as well."""

import os
import resource
import shutil
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Procs, haproxy_config, hello_nginx, rss_kib, shipped_config, start_sluice, wait_http  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
UPSTREAM, SLUICE_PORT, ADMIN, HAPROXY = 18130, 13190, 19990, 13191


def descriptors(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def hold(port, request, n=N):
    """Opens `n` connections, each sends `request` and reads its answer; returns them."""
    conns = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(request)
        got = b""
        while b"hello" not in got:
            chunk = s.recv(4096)
            if not chunk:
                raise SystemExit(f"port {port} closed a connection: {got[:200]!r}")
            got += chunk
        conns.append(s)
    return conns


def measure(name, pid, port, request):
    # Warm-up: threads, pools and buffers that exist once. Only a few connections: an
    # allocator or pool keeps what N connections freed, and the next N would look free.
    for s in hold(port, request, 10):
        s.close()
    time.sleep(1)
    rss0, fd0 = rss_kib(pid), descriptors(pid)
    conns = hold(port, request)
    time.sleep(2)
    rss1, fd1 = rss_kib(pid), descriptors(pid)
    print(f"| {name} | {N} | {rss0 / 1024:.1f} | {rss1 / 1024:.1f} | {(rss1 - rss0) * 1024 / N / 1024:.1f} | "
          f"{(fd1 - fd0) / N:.2f} |")
    for s in conns:
        s.close()


def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * N + 256)), hard))
    procs = Procs()
    work = tempfile.mkdtemp(prefix="sluice-idle-")
    try:
        hello_nginx(procs, work, [UPSTREAM])
        sluice = start_sluice(procs, shipped_config(work, "sluice.toml", SLUICE_PORT, ADMIN))
        wait_http(f"http://127.0.0.1:{ADMIN}/readyz")
        h = procs.start(["haproxy", "-db", "-f", haproxy_config(work, "h.cfg", HAPROXY, UPSTREAM, 2)])
        time.sleep(1)
        procs.check_alive()
        print("| proxy | idle connections | RSS before, MiB | RSS with them, MiB | KiB per connection | "
              "descriptors per connection |")
        print("| --- | --- | --- | --- | --- | --- |")
        measure("sluice as shipped", sluice.pid, SLUICE_PORT,
                f"GET http://127.0.0.1:{UPSTREAM}/ HTTP/1.1\r\nHost: 127.0.0.1:{UPSTREAM}\r\n\r\n".encode())
        measure("haproxy, 2 threads", h.pid, HAPROXY, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)


main()

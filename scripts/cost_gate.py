"""The cost gate (scripts/check-cost): user-space instructions and allocations per
request, counted under callgrind, against the budgets in scripts/cost-budgets.toml.

Counts, not timings: callgrind executes the same instructions for the same binary and
inputs whatever else the machine is doing, so the gate can be strict without flaking.
sluice runs as shipped (the default log level, an access line per request, stderr read
through a pipe), with one worker so that every request takes the same path, behind one
keep-alive connection that sends its requests one at a time. For each kind of request a
warm-up goes uncounted; then callgrind's counters are zeroed, a fixed number of
requests is sent, and the counters are dumped. Every thread counts: the log writer's
too.

- unmatched: a host no upstream names, passed through;
- matched: a configured upstream whose family pays a token bucket that never makes
  anyone wait;
- limited: a family whose limit is spent, answered 429 by sluice at once.

Allocations are the calls into the C allocator (malloc, calloc, realloc and the aligned
ones), read from the call graph in callgrind's dump.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from common import Procs, callgrind_counts, callgrind_dump, hello_nginx, start_under_callgrind  # noqa: E402

BINARY, BUDGETS = sys.argv[1], sys.argv[2]
COUNTED = int(os.environ.get("COST_REQUESTS", "2000"))
WARMUP = 300


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, what, proc=None, seconds=120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"check-cost: {what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"check-cost: {what} did not listen on {port} within {seconds}s")


class Client:
    """One keep-alive connection to the proxy, sending absolute-form requests one at a
    time and reading each response in full."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.buf = b""

    def get(self, target, expect):
        host = target.split("/")[2]
        self.sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: check-cost\r\n\r\n".encode())
        while b"\r\n\r\n" not in self.buf:
            self.recv()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        status = int(head.split(b" ", 2)[1])
        length = int(re.search(rb"(?im)^content-length:\s*(\d+)", head).group(1))
        while len(self.buf) < length:
            self.recv()
        self.buf = self.buf[length:]
        if status != expect:
            raise SystemExit(f"check-cost: {target} answered {status}, expected {expect}:\n{head.decode()}")

    def recv(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise SystemExit("check-cost: the proxy closed the connection")
        self.buf += chunk


def main():
    budgets = tomllib.load(open(BUDGETS, "rb"))
    tolerance = budgets["tolerance"]
    work = tempfile.mkdtemp(prefix="sluice-cost-")
    ports = {k: free_port() for k in ("unmatched", "matched", "limited", "proxy", "admin")}
    sluice_conf = os.path.join(work, "sluice.toml")
    with open(sluice_conf, "w") as f:
        f.write(f"""[proxy]
listen = "127.0.0.1:{ports['proxy']}"
admin = "127.0.0.1:{ports['admin']}"
[egress]
allow = ["127.0.0.1"]
[[upstream]]
name = "matched"
hosts = ["127.0.0.1:{ports['matched']}"]
limits = [{{ kind = "token_bucket", rate = 100000000, per = "1s", burst = 100000000 }}]
  [[upstream.family]]
  name = "all"
  paths = ["/**"]
[[upstream]]
name = "limited"
hosts = ["127.0.0.1:{ports['limited']}"]
max_wait = "1s"
  [[upstream.family]]
  name = "all"
  paths = ["/**"]
  limits = [{{ kind = "fixed_window", permits = 1, window = "1h" }}]
""")
    procs = Procs()
    try:
        nginx = hello_nginx(procs, work, [ports[k] for k in ("unmatched", "matched", "limited")])
        sluice = start_under_callgrind(procs, work, sluice_conf, BINARY)
        for k in ("unmatched", "matched", "limited"):
            wait_port(ports[k], "nginx", nginx)
        wait_port(ports["admin"], "sluice under callgrind", sluice)
        client = Client(ports["proxy"])
        results, failed = [], False
        for kind, expect in (("unmatched", 200), ("matched", 200), ("limited", 429)):
            target = f"http://127.0.0.1:{ports[kind]}/v1/items/42"
            # The limited family's one permit goes to the first request of its warm-up;
            # every request after it is refused.
            client.get(target, 200)
            for _ in range(WARMUP):
                client.get(target, expect)
            subprocess.run(["callgrind_control", "-z", str(sluice.pid)], check=True, capture_output=True)
            for _ in range(COUNTED):
                client.get(target, expect)
            dump = callgrind_dump(work, sluice.pid)
            total, allocs = callgrind_counts(dump)
            if os.environ.get("COST_KEEP"):
                # COST_KEEP=<prefix>: keeps each dump, for callgrind_annotate or kcachegrind.
                shutil.copy(dump, f"{os.environ['COST_KEEP']}.{kind}")
            # A request is tens of thousands of instructions and several allocations: a
            # figure far below that means the dump was misread (another valgrind naming
            # the allocator differently, say), and a gate reading zeros would pass
            # anything.
            if total / COUNTED < 5_000 or allocs / COUNTED < 1:
                raise SystemExit(f"check-cost: {kind}: {total / COUNTED:,.0f} instructions and "
                                 f"{allocs / COUNTED:.2f} allocations per request cannot be right; "
                                 f"is the callgrind dump read as it is written? ({dump})")
            results.append((kind, total / COUNTED, allocs / COUNTED))
        print(f"| request | instructions | budget | allocations | budget |  ({COUNTED} requests each, tolerance {tolerance:.0%})")
        for kind, ir, allocs in results:
            b = budgets[kind]
            marks = []
            for what, value, budget in (("instructions", ir, b["instructions"]), ("allocations", allocs, b["allocations"])):
                if value > budget * (1 + tolerance):
                    marks.append(f"{what} {value:,.1f} over the budget {budget:,} by {value / budget - 1:.1%}")
                    failed = True
                elif value < budget * (1 - 2 * tolerance):
                    marks.append(f"{what} {value:,.1f} well under the budget {budget:,}: lower it")
            print(f"| {kind} | {ir:,.0f} | {b['instructions']:,} | {allocs:.2f} | {b['allocations']} | {'; '.join(marks)}")
        sys.stdout.flush()
        if failed:
            raise SystemExit("check-cost: a request costs more than its budget (scripts/cost-budgets.toml). "
                             "Find the work added (bench/callgrind.sh --top), or raise the budget in the "
                             "same commit and say why.")
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)


main()

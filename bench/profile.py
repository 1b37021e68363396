"""Where a proxied request's CPU goes, sluice and haproxy side by side (see profile.sh):
sluice as shipped, sluice with the log off and haproxy (2 threads) in front of the same
nginx, each loaded in turn by wrk -t1 -c32 through the matched upstream, while
`perf record -e cpu-clock` samples the proxy's threads. Prints per target the rate,
CPU microseconds per request, the share of samples in the kernel, page faults per
request, and the functions with the most samples of their own. Then, under a second
load, `perf stat` (software counters, and the hardware ones where the machine has them)
and the bytes each read, write, recvfrom, sendto and writev moved, from their exit
tracepoints; recording those slows the proxy, so the rate of that phase is not the
figure to quote."""

import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Procs, cpu_seconds, hello_nginx, shipped_off_haproxy, wrk_argv  # noqa: E402

SECONDS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
TOP = int(sys.argv[2]) if len(sys.argv) > 2 else 12
CONNS = int(sys.argv[3]) if len(sys.argv) > 3 else 32
IO = ["read", "write", "recvfrom", "sendto", "writev"]
STAT = ["task-clock", "context-switches", "cpu-migrations", "page-faults", "cycles", "instructions",
        "cache-misses", "branch-misses"]
UPSTREAM = 18120
PORTS = [13180, 19980, 13181, 19981, 13182]


def main():
    procs = Procs()
    work = tempfile.mkdtemp(prefix="sluice-profile-")
    try:
        hello_nginx(procs, work, [UPSTREAM])
        targets = shipped_off_haproxy(procs, work, UPSTREAM, PORTS)
        for name, url, script, p in targets:
            wrk = wrk_argv(url, CONNS, SECONDS + 2, script, threads=1)
            load = subprocess.Popen(wrk, stdout=subprocess.PIPE, text=True)
            subprocess.run(["sleep", "1"])
            data = os.path.join(work, "perf.data")
            before = cpu_seconds([p.pid])
            faults_before = int(open(f"/proc/{p.pid}/stat").read().split(")")[1].split()[7])
            subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", "4000", "-p", str(p.pid),
                            "-o", data, "--", "sleep", str(SECONDS)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            cpu = cpu_seconds([p.pid]) - before
            faults = int(open(f"/proc/{p.pid}/stat").read().split(")")[1].split()[7]) - faults_before
            out = load.communicate()[0]
            rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
            report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso,symbol",
                                     "--stdio", "-q", "--percent-limit", "0.5"],
                                    capture_output=True, text=True).stdout
            rows = re.findall(r"^\s+([\d.]+)%\s+(\S+)\s+\[([.k])\]\s+(.+?)(?:\s+-\s+-)?\s*$", report, re.M)
            dsos = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso",
                                   "--stdio", "-q"], capture_output=True, text=True).stdout
            kernel = sum(float(m) for m in re.findall(r"^\s+([\d.]+)%\s+\[kernel", dsos, re.M))
            requests = rate * SECONDS
            print(f"\n### {name}\n")
            print(f"{rate:,.0f} req/s; {cpu / requests * 1e6:.1f} µs CPU per request; "
                  f"{kernel:.0f}% of samples in the kernel; "
                  f"{faults / requests:.3f} minor faults per request\n")
            print("| self % | where | function |")
            print("| --- | --- | --- |")
            for pct, dso, ring, fn in rows[:TOP]:
                print(f"| {pct} | {'kernel' if ring == 'k' else dso} | `{fn.strip()[:90]}` |")
            io_and_stat(work, wrk, p.pid)
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)


def io_and_stat(work, wrk, pid):
    """perf stat and the bytes per I/O call of `pid` under a second run of `wrk`."""
    load = subprocess.Popen(wrk, stdout=subprocess.PIPE, text=True)
    subprocess.run(["sleep", "1"])
    data, stat = os.path.join(work, "io.data"), os.path.join(work, "stat.txt")
    counting = subprocess.Popen(["perf", "stat", "-x,", "-o", stat, "-p", str(pid)]
                                + [a for e in STAT for a in ("-e", e)] + ["--", "sleep", str(SECONDS)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run(["perf", "record", "-q", "-p", str(pid), "-o", data]
                   + [a for c in IO for a in ("-e", f"syscalls:sys_exit_{c}")] + ["--", "sleep", str(SECONDS)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    counting.wait()
    out = load.communicate()[0]
    requests = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)) * SECONDS
    calls, moved = {c: 0 for c in IO}, {c: 0 for c in IO}
    script = subprocess.run(["perf", "script", "-i", data, "-F", "event,trace"],
                            capture_output=True, text=True).stdout
    for m in re.finditer(r"sys_exit_(\w+):.*?0x([0-9a-f]+)\s*$", script, re.M):
        ret = int(m.group(2), 16)
        if m.group(1) in calls:
            calls[m.group(1)] += 1
            # A negative return (EAGAIN) is printed as a large unsigned number.
            moved[m.group(1)] += ret if ret < 1 << 62 else 0
    print(f"\nUnder a second load ({requests / SECONDS:,.0f} req/s while traced):\n")
    print("| call | per request | bytes per call |")
    print("| --- | --- | --- |")
    for c in IO:
        if calls[c]:
            print(f"| {c} | {calls[c] / requests:.2f} | {moved[c] / calls[c]:,.0f} |")
    counted = {}
    for line in open(stat):
        f = line.strip().split(",")
        if len(f) > 2 and f[2]:
            counted[f[2]] = f[0]
    def per_request(event, value):
        if not value.replace(".", "").isdigit():
            return f"{event} {value}"
        if event == "task-clock":  # milliseconds
            return f"task-clock {float(value) * 1000 / requests:.1f} µs/req"
        return f"{event} {float(value) / requests:,.3f}/req"
    print("\nperf stat: " + "; ".join(per_request(e, v) for e, v in counted.items()))


main()

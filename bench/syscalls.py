"""Per proxied request, what each proxy asks of the kernel and what the whole machine
spends (see syscalls.sh): system calls and context switches from perf's tracepoints
(system-wide and the proxy's own), CPU from /proc for the proxy, its log writer thread,
the thread here that reads its stderr pipe (as a container runtime would), nginx and wrk.

Each round shuffles the targets' order; each figure is the median over rounds, and the
rate is also given as the median of its round-by-round ratio to haproxy's.
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import Procs, family_pids, hello_nginx, round_order, shipped_off_haproxy, wrk

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 6
SECONDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
THREADS = int(sys.argv[3]) if len(sys.argv) > 3 else 1
CONNS = int(os.environ.get("CONNS", "32"))
UP, SHIPPED, OFF, HAPROXY, ADMIN = 18470, 18471, 18472, 18473, 18474
CALLS = ["read", "write", "writev", "recvfrom", "sendto", "epoll_wait", "epoll_ctl", "futex"]
EVENTS = ["raw_syscalls:sys_enter", "sched:sched_switch"] + [f"syscalls:sys_enter_{c}" for c in CALLS]
TICK = os.sysconf("SC_CLK_TCK")


def perf_stat(target, out):
    cmd = ["perf", "stat", "-x,", "-o", out] + [a for e in EVENTS for a in ("-e", e)] + target
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def read_perf(path):
    counts = {}
    try:
        for line in open(path):
            f = line.strip().split(",")
            if len(f) > 2 and f[0].isdigit():
                event = f[2].split(":")[-1]
                counts["calls" if event == "sys_enter" else event.removeprefix("sys_enter_")] = int(f[0])
    except OSError:
        pass
    return counts


def thread_cpu(pid, tid=None, comm=None):
    """CPU seconds of a process's threads: all of them, the one `tid`, or those named
    `comm`."""
    total = 0
    try:
        tasks = [str(tid)] if tid else os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for t in tasks:
        try:
            if comm and open(f"/proc/{pid}/task/{t}/comm").read().strip() != comm:
                continue
            f = open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except OSError:
            pass
    return total / TICK


def main():
    work = tempfile.mkdtemp(prefix="sluice-syscalls-")
    procs = Procs()
    try:
        ng = hello_nginx(procs, work, [UP])
        time.sleep(0.5)
        nginx = family_pids(ng.pid)
        targets = shipped_off_haproxy(procs, work, UP, (SHIPPED, ADMIN, OFF, ADMIN + 1, HAPROXY))
        rows = {t[0]: [] for t in targets}
        for r in range(ROUNDS):
            for name, url, script, p in round_order(targets, r):
                reader = getattr(p, "drain_tid", None)

                def cpu():
                    return {
                        "proxy": thread_cpu(p.pid),
                        "log writer": thread_cpu(p.pid, comm="sluice-log"),
                        "pipe reader": thread_cpu(os.getpid(), tid=reader) if reader else 0.0,
                        "nginx": sum(thread_cpu(n) for n in nginx),
                    }

                own = perf_stat(["-p", str(p.pid)], f"{work}/own.txt")
                every = perf_stat(["-a"], f"{work}/all.txt")
                time.sleep(0.3)
                before = cpu()
                w0 = os.times()
                rps, _, _, n = wrk(url, CONNS, SECONDS, script, THREADS, count=True)
                w1 = os.times()
                after = cpu()
                for s in (own, every):
                    s.send_signal(2)
                    s.wait()
                row = {"rps": rps}
                for k in before:
                    row[f"{k} µs"] = (after[k] - before[k]) / n * 1e6
                wrk_cpu = (w1.children_user - w0.children_user) + (w1.children_system - w0.children_system)
                row["wrk µs"] = wrk_cpu / n * 1e6
                row["total µs"] = row["proxy µs"] + row["pipe reader µs"] + row["nginx µs"] + row["wrk µs"]
                for scope, path in (("own", "own.txt"), ("all", "all.txt")):
                    for k, v in read_perf(f"{work}/{path}").items():
                        row[f"{scope} {k}"] = v / n
                rows[name].append(row)
        report(rows)
    finally:
        procs.stop_all()


def report(rows):
    names = list(rows)
    hp = rows["haproxy, 2 threads"]
    print(f"wrk -t{THREADS} -c{CONNS}, {ROUNDS} rounds x {SECONDS} s; per request, medians")
    print("| | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))

    def line(label, key, fmt):
        cells = []
        for n in names:
            values = [r.get(key) for r in rows[n] if r.get(key) is not None]
            cells.append(fmt.format(statistics.median(values)) if values else "–")
        print(f"| {label} | " + " | ".join(cells) + " |")

    line("req/s", "rps", "{:.0f}")
    ratios = [f"{statistics.median(a['rps'] / b['rps'] for a, b in zip(rows[n], hp)) * 100:.0f}%"
              for n in names]
    print("| req/s vs haproxy, round by round | " + " | ".join(ratios) + " |")
    for k in ["proxy", "log writer", "pipe reader", "nginx", "wrk", "total"]:
        line(f"CPU µs: {k}", f"{k} µs", "{:.2f}")
    line("system calls: proxy's own", "own calls", "{:.2f}")
    line("system calls: whole machine", "all calls", "{:.2f}")
    line("context switches: proxy's own", "own sched_switch", "{:.2f}")
    line("context switches: whole machine", "all sched_switch", "{:.2f}")
    for c in CALLS:
        line(f"`{c}`: proxy's own", f"own {c}", "{:.2f}")
    for n in names:
        for r in rows[n]:
            if "own calls" in r:
                r["own other"] = r["own calls"] - sum(r.get(f"own {c}", 0) for c in CALLS)
    line("any other call: proxy's own", "own other", "{:.2f}")


if __name__ == "__main__":
    main()

"""Context switches per 1000 proxied requests, machine-wide, by who stopped and why
(see switches.sh). `finish_task_switch` is the proxy's largest kernel symbol under
`perf record` on this VM, so two proxies that make the same system calls can still
differ in what they cost the machine; this says where the switches come from.

Tasks are grouped as the proxy (all its threads), wrk, nginx and the rest (the pipe's
reader, perf, kernel threads). A task that stopped while still runnable was preempted,
by the task named; one that stopped otherwise slept. Switches away from the idle task
are not counted: they only say that a CPU had nothing to run. Each round shuffles the
targets' order; figures are medians over rounds.
"""

import collections
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from common import Procs, hello_nginx, round_order, shipped_off_haproxy, wrk

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
SECONDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
THREADS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
CONNS = int(os.environ.get("CONNS", "32"))
UP, SHIPPED, OFF, HAPROXY, ADMIN = 18480, 18481, 18482, 18483, 18484
SWITCH = re.compile(r"prev_comm=(.+?) prev_pid=(\d+) .*?prev_state=(\S+) ==> next_comm=(.+?) next_pid=(\d+)")


def group(comm, pid, proxy_tids):
    if pid in proxy_tids:
        return "proxy"
    if comm.startswith("wrk"):
        return "wrk"
    if comm.startswith("nginx"):
        return "nginx"
    return "other"


def switches(data, proxy_pid):
    """Counts of (who stopped, how): how is "slept" or "preempted by <group>"."""
    tids = {int(t) for t in os.listdir(f"/proc/{proxy_pid}/task")}
    out = subprocess.run(["perf", "script", "-i", data, "-F", "trace"], capture_output=True, text=True).stdout
    counts = collections.Counter()
    for m in SWITCH.finditer(out):
        prev_comm, prev_pid, state, next_comm, next_pid = m.groups()
        if prev_comm.startswith("swapper"):
            continue
        who = group(prev_comm, int(prev_pid), tids)
        how = f"preempted by {group(next_comm, int(next_pid), tids)}" if state.startswith("R") else "slept"
        counts[(who, how)] += 1
    return counts


def main():
    work = tempfile.mkdtemp(prefix="sluice-switches-")
    procs = Procs()
    try:
        hello_nginx(procs, work, [UP])
        time.sleep(0.5)
        targets = shipped_off_haproxy(procs, work, UP, (SHIPPED, ADMIN, OFF, ADMIN + 1, HAPROXY))
        rows = {t[0]: [] for t in targets}
        data = os.path.join(work, "sched.data")
        for r in range(ROUNDS):
            for name, url, script, p in round_order(targets, r):
                wrk(url, CONNS, 1, script, THREADS)
                rec = subprocess.Popen(["perf", "record", "-q", "-a", "-e", "sched:sched_switch", "-o", data],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.5)
                rps, _, _, n = wrk(url, CONNS, SECONDS, script, THREADS, count=True)
                rec.send_signal(2)
                rec.wait()
                row = {k: v / n * 1000 for k, v in switches(data, p.pid).items()}
                row["rps"] = rps
                rows[name].append(row)
        report(rows)
    finally:
        procs.stop_all()


def report(rows):
    names = list(rows)
    keys = sorted({k for rs in rows.values() for r in rs for k in r if k != "rps"},
                  key=lambda k: -statistics.median(r.get(k, 0) for r in rows[names[0]]))
    print(f"wrk -t{THREADS} -c{CONNS}, {ROUNDS} rounds x {SECONDS} s; context switches per 1000 requests, "
          "machine-wide, medians")
    print("| | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))

    def cells(f):
        return " | ".join(f(rows[n]) for n in names)

    print("| req/s | " + cells(lambda rs: f"{statistics.median(r['rps'] for r in rs):.0f}") + " |")
    def total(rs):
        return f"{statistics.median(sum(v for k, v in r.items() if k != 'rps') for r in rs):.0f}"

    print("| all switches but the idle task's | " + cells(total) + " |")
    for k in keys:
        if max(statistics.median(r.get(k, 0) for r in rows[n]) for n in names) >= 1:
            print(f"| {k[0]} {k[1]} | " + cells(lambda rs: f"{statistics.median(r.get(k, 0) for r in rs):.1f}") + " |")


if __name__ == "__main__":
    main()

"""How often a proxy's two busiest threads share one CPU under load (see colocation.sh):
the cause of sluice's unpinned tail ("The tail" in docs/BENCHMARKS.md) is two workers
the scheduler leaves on one CPU, taking turns. Every 0.5 ms the script reads the CPU
each thread last ran on and its state from /proc; it reports the share of samples in
which the two threads that were most often running sat on the same CPU, and the share
in which both were runnable there (one waiting for the other). Rounds interleave;
medians."""

import collections
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Procs, hello_nginx, round_order, shipped_off_haproxy, wrk_argv  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
SECONDS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
UPSTREAM = 18150
PORTS = [13210, 19996, 13211, 19997, 13212]


def sample(pid, seconds):
    """(thread, cpu, state) for every thread of `pid`, every 0.5 ms for `seconds`."""
    samples, end = [], time.monotonic() + seconds
    tids = os.listdir(f"/proc/{pid}/task")
    while time.monotonic() < end:
        row = []
        for t in tids:
            try:
                f = open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            row.append((t, int(f[36]), f[0]))
        samples.append(row)
        time.sleep(0.0005)
    return samples


def shares(samples):
    running = collections.Counter(t for row in samples for t, _, state in row if state == "R")
    two = [t for t, _ in running.most_common(2)]
    same = waiting = 0
    for row in samples:
        at = {t: (cpu, state) for t, cpu, state in row}
        if len(two) == 2 and all(t in at for t in two) and at[two[0]][0] == at[two[1]][0]:
            same += 1
            waiting += at[two[0]][1] == "R" and at[two[1]][1] == "R"
    return same / len(samples), waiting / len(samples)


def main():
    procs = Procs()
    work = tempfile.mkdtemp(prefix="sluice-colocation-")
    try:
        hello_nginx(procs, work, [UPSTREAM])
        targets = shipped_off_haproxy(procs, work, UPSTREAM, PORTS)
        results = {name: [] for name, _, _, _ in targets}
        for r in range(ROUNDS):
            for name, url, script, p in round_order(targets, r):
                wrk = wrk_argv(url, 32, SECONDS + 2, script, threads=1)
                load = subprocess.Popen(wrk, stdout=subprocess.DEVNULL)
                time.sleep(1)
                results[name].append(shares(sample(p.pid, SECONDS)))
                load.wait()
        print(f"wrk -t1 -c32, {ROUNDS} rounds x {SECONDS} s, medians (min–max)\n")
        print("| target | the two busiest threads on one CPU | both runnable there |")
        print("| --- | --- | --- |")
        for name, values in results.items():
            cols = list(zip(*values))
            cell = lambda v: f"{statistics.median(v):.1%} ({min(v):.1%}–{max(v):.1%})"  # noqa: E731
            print(f"| {name} | {cell(cols[0])} | {cell(cols[1])} |")
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)


main()

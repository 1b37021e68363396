"""Pass-through cost next to the proxies a user would pick instead, on equal footing: every
target sits in front of the same nginx `return 200`; wrk drives each with 32 connections,
once with one thread and once with two; targets interleave over the rounds.

- sluice as shipped: the bundled config/sluice.toml (ports changed, loopback allowed), the
  default log level, one access line per request on stderr read through a pipe; its twin
  with RUST_LOG=warn (access log off); and one as shipped with one worker
  (SLUICE_WORKERS=1), for the one-thread comparison.
- haproxy (reverse) with as many threads as sluice has workers, and with one thread; its
  defaults otherwise (`http-reuse safe`, no log). On request only (ONLY=haproxy-via), the
  first with a `Via` field added both ways, as sluice adds it (RFC 9110 §7.6.3) and
  haproxy by default does not: what that duty costs a proxy and its client.
- nginx (reverse) with as many worker processes as sluice has workers, no access log.
- squid and tinyproxy (forward) as packaged, one process each (their SMP modes are not
  what a sidecar runs).

Each row: median (min-max) req/s, p50 and p99, the proxy's CPU and its user and system
CPU per request, and RSS after the run. The machine's speed swings by tens of percent
within a minute, so each sluice row also has its ratio to haproxy with the same thread
count, taken round by round (the two ran seconds apart) and then the median of those;
the targets' order is shuffled every round (`common.round_order`), so that none always
follows the same one.
A second table gives the CPU per request of every process the requests pass through: the
proxy, wrk, the upstream nginx, and the thread reading sluice's stderr. They share the
machine's cores, so a proxy can spend less per request than another and still reach a
lower rate, when the client pays more to read its answers or its log is read.
Below each table, the ratios the targets are judged by (as shipped against haproxy and
against the log off) with a 95% bootstrap interval of their median: an interval that
straddles 100% is a tie on this machine, whatever the median says.
Run by bench/peers.sh.
"""

import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from common import (
    Procs,
    absolute_form_script,
    context_switches,
    cpu_split,
    family_pids,
    haproxy_config,
    median_interval,
    round_order,
    rss_kib,
    shipped_config,
    start_sluice,
    wait_http,
    wrk,
    wrk_argv,
)

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
SECONDS = int(sys.argv[2]) if len(sys.argv) > 2 else 10
# CONNS=256: many connections (issue table at -c256); 32 otherwise.
CONNS = int(os.environ.get("CONNS", "32"))
# sluice starts one worker per CPU it may run on; the peers get as many threads.
WORKERS = len(os.sched_getaffinity(0))
UP = 18200
PORTS = {"sluice": 13160, "squid": 13161, "tinyproxy": 13162, "haproxy": 13163, "nginx": 13164,
         "baseline": 13165, "sluice-off": 13166, "haproxy-1": 13167, "sluice-1": 13168,
         "haproxy-via": 13169}
# Another sluice binary to compare with, e.g. a build of the previous commit.
BASELINE = os.environ.get("BASELINE")
# Comma-separated names to measure (default all), e.g. ONLY=sluice,haproxy for an A/B.
ONLY = os.environ.get("ONLY")
ADMIN = 19941
# The instances compared with haproxy round by round.
PAIRED = {"sluice", "sluice-off", "sluice-1", "baseline"}

work = tempfile.mkdtemp(prefix="sluice-peers-")
os.chmod(work, 0o755)
procs = Procs()


def write(name, text):
    path = os.path.join(work, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def main():
    upstream = write("up.conf", f"""worker_processes 1; daemon off; pid {work}/up.pid; error_log {work}/up.err;
events {{ worker_connections 4096; }}
http {{ access_log off; keepalive_requests 1000000;
  server {{ listen 127.0.0.1:{UP}; location / {{ return 200 "hello\\n"; }} }} }}
""")
    upstream_nginx = procs.start(["nginx", "-c", upstream, "-p", work])
    reverse = write("rev.conf", f"""worker_processes {WORKERS}; daemon off; pid {work}/rev.pid; error_log {work}/rev.err;
events {{ worker_connections 4096; }}
http {{ access_log off; keepalive_requests 1000000;
  upstream up {{ server 127.0.0.1:{UP}; keepalive 64; }}
  server {{ listen 127.0.0.1:{PORTS["nginx"]};
    location / {{ proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection ""; }} }} }}
""")
    haproxy = haproxy_config(work, "haproxy.cfg", PORTS["haproxy"], UP, WORKERS)
    haproxy_1 = haproxy_config(work, "haproxy-1.cfg", PORTS["haproxy-1"], UP, 1)
    haproxy_via = haproxy_config(work, "haproxy-via.cfg", PORTS["haproxy-via"], UP, WORKERS,
                                 frontend=['http-request add-header via "1.1 haproxy"',
                                           'http-response add-header via "1.1 haproxy"'])
    squid = write("squid.conf", f"""http_port 127.0.0.1:{PORTS["squid"]}
http_access allow all
cache deny all
access_log none
cache_log /dev/null
pid_filename {work}/squid.pid
coredump_dir {work}
workers 1
shutdown_lifetime 1 seconds
""")
    tiny = write("tinyproxy.conf", f"""Port {PORTS["tinyproxy"]}
Listen 127.0.0.1
MaxClients 256
LogLevel Critical
PidFile "{work}/tinyproxy.pid"
""")
    shipped = start_sluice(procs, shipped_config(work, "sluice.toml", PORTS["sluice"], ADMIN))
    off = start_sluice(procs, shipped_config(work, "sluice-off.toml", PORTS["sluice-off"], ADMIN + 2), log="off")
    # One worker, for the one-thread comparison with haproxy.
    one = start_sluice(procs, shipped_config(work, "sluice-1.toml", PORTS["sluice-1"], ADMIN + 3),
                       extra_env={"SLUICE_WORKERS": "1"})
    pids = {
        "sluice": shipped.pid,
        "sluice-off": off.pid,
        "sluice-1": one.pid,
        "squid": procs.start(["squid", "-N", "-f", squid]).pid,
        "tinyproxy": procs.start(["tinyproxy", "-d", "-c", tiny]).pid,
        "haproxy": procs.start(["haproxy", "-db", "-f", haproxy]).pid,
        "haproxy-1": procs.start(["haproxy", "-db", "-f", haproxy_1]).pid,
        "haproxy-via": procs.start(["haproxy", "-db", "-f", haproxy_via]).pid,
        "nginx": procs.start(["nginx", "-c", reverse, "-p", work]).pid,
    }
    if BASELINE:
        base_conf = shipped_config(work, "baseline.toml", PORTS["baseline"], ADMIN + 1)
        baseline = start_sluice(procs, base_conf, binary=BASELINE)
        pids["baseline"] = baseline.pid
        wait_http(f"http://127.0.0.1:{ADMIN + 1}/readyz")
    wait_http(f"http://127.0.0.1:{ADMIN + 2}/readyz")
    wait_http(f"http://127.0.0.1:{ADMIN + 3}/readyz")
    wait_http(f"http://127.0.0.1:{UP}/")
    wait_http(f"http://127.0.0.1:{ADMIN}/readyz")
    wait_http(f"http://127.0.0.1:{PORTS['haproxy']}/")
    wait_http(f"http://127.0.0.1:{PORTS['haproxy-1']}/")
    wait_http(f"http://127.0.0.1:{PORTS['haproxy-via']}/")
    wait_http(f"http://127.0.0.1:{PORTS['nginx']}/")
    time.sleep(2)  # squid and tinyproxy take a moment to listen
    procs.check_alive()
    forward = absolute_form_script(work, UP)

    targets = [
        ("direct", f"http://127.0.0.1:{UP}/", None, None),
        ("sluice as shipped (forward)", f"http://127.0.0.1:{PORTS['sluice']}", forward, "sluice"),
        ("sluice, access log off (forward)", f"http://127.0.0.1:{PORTS['sluice-off']}", forward, "sluice-off"),
        ("sluice as shipped, 1 worker (forward)", f"http://127.0.0.1:{PORTS['sluice-1']}", forward, "sluice-1"),
    ] + ([
        ("sluice baseline as shipped (forward)", f"http://127.0.0.1:{PORTS['baseline']}", forward, "baseline"),
    ] if BASELINE else []) + [
        (f"haproxy, {WORKERS} threads (reverse)", f"http://127.0.0.1:{PORTS['haproxy']}/", None, "haproxy"),
        ("haproxy, 1 thread (reverse)", f"http://127.0.0.1:{PORTS['haproxy-1']}/", None, "haproxy-1"),
        (f"haproxy, {WORKERS} threads, adding Via (reverse)", f"http://127.0.0.1:{PORTS['haproxy-via']}/",
         None, "haproxy-via"),
        (f"nginx, {WORKERS} workers (reverse)", f"http://127.0.0.1:{PORTS['nginx']}/", None, "nginx"),
        ("squid (forward)", f"http://127.0.0.1:{PORTS['squid']}", forward, "squid"),
        ("tinyproxy (forward)", f"http://127.0.0.1:{PORTS['tinyproxy']}", forward, "tinyproxy"),
    ]
    # The Via variant only when asked for: the default run's table stays as it was.
    wanted = ONLY.split(",") if ONLY else [t[3] for t in targets if t[3] != "haproxy-via"]
    targets = [t for t in targets if t[0] == "direct" or t[3] in wanted]
    for _, url, script, _ in targets:
        subprocess.run(wrk_argv(url, 4, 1, script, threads=1), capture_output=True, check=True)
    readers = {"sluice": shipped, "sluice-off": off, "sluice-1": one}
    if BASELINE:
        readers["baseline"] = baseline
    for threads in [1, 2]:
        measure(targets, pids, threads, shipped, [r for w, r in readers.items() if w != "sluice-off"],
                (upstream_nginx.pid, readers))


def settle(logging):
    """Waits until the readers of the logging instances' stderr have caught up, so that
    the next target is not measured while this one's log lines are still being read."""
    last = None
    while last != [p.log_lines[0] for p in logging]:
        last = [p.log_lines[0] for p in logging]
        time.sleep(0.5)


def thread_cpu(tid):
    """User + system CPU seconds so far of thread `tid` of this process."""
    try:
        fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu():
    """User + system CPU seconds of the child processes waited for so far (wrk's)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measure(targets, pids, threads, shipped, logging, others):
    upstream_pid, readers = others
    results = {t[0]: [] for t in targets}
    cpu = {t[0]: [] for t in targets}
    # CPU microseconds per request, user and system, of the proxy's processes.
    per_req = {t[0]: [] for t in targets}
    # Context switches per 1000 requests, voluntary and involuntary.
    switches = {t[0]: [] for t in targets}
    # CPU microseconds per request of every process the load runs through: the proxy, wrk,
    # the upstream nginx and the thread here reading the proxy's stderr. The machine's
    # cores are shared by all of them, so a rate is set by their sum, not the proxy's alone.
    machine = {t[0]: [] for t in targets}
    upstream = family_pids(upstream_pid)
    for r in range(ROUNDS):
        for name, url, script, who in round_order(targets, r):
            watched = family_pids(pids[who]) if who else []
            u0, s0 = cpu_split(watched)
            v0, i0 = context_switches(watched)
            reader = readers.get(who)
            up0, c0 = sum(cpu_split(upstream)), children_cpu()
            r0 = thread_cpu(reader.drain_tid) if reader else 0.0
            results[name].append(wrk(url, CONNS, SECONDS, script, threads))
            u1, s1 = cpu_split(watched)
            v1, i1 = context_switches(watched)
            up1, c1 = sum(cpu_split(upstream)), children_cpu()
            cpu[name].append((u1 + s1 - u0 - s0) / SECONDS * 100)
            n = results[name][-1][0] * SECONDS
            per_req[name].append(((u1 - u0) / n * 1e6, (s1 - s0) / n * 1e6))
            switches[name].append(((v1 - v0) / n * 1000, (i1 - i0) / n * 1000))
            settle(logging)
            # Lines still unread when wrk ended are read during the settle: theirs too.
            r1 = thread_cpu(reader.drain_tid) if reader else 0.0
            machine[name].append(((u1 + s1 - u0 - s0) / n * 1e6, (c1 - c0) / n * 1e6,
                                  (up1 - up0) / n * 1e6, (r1 - r0) / n * 1e6))
            print(f"wrk -t{threads} round {r + 1} {name}: {results[name][-1][0]:.0f} req/s", file=sys.stderr)

    def cell(values, fmt):
        return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"

    direct = statistics.median(v[0] for v in results["direct"])
    print(f"\nwrk -t{threads} -c{CONNS} -d{SECONDS}s, {ROUNDS} rounds interleaved, "
          f"sluice with {WORKERS} workers; median (min–max)\n")
    names = {who: name for name, _, _, who in targets}

    def versus(name, who, column):
        """Median over rounds of this target's figure over its haproxy peer's in the same
        round (the peer with as many threads, or one for the one-worker instance)."""
        peer = names.get("haproxy-1" if who == "sluice-1" else "haproxy")
        if who not in PAIRED or peer is None:
            return "–"
        ratios = [a[column] / b[column] for a, b in zip(results[name], results[peer])]
        return f"{statistics.median(ratios) * 100:.0f}% ({min(ratios) * 100:.0f}–{max(ratios) * 100:.0f})"

    print("| target | req/s | % of direct | req/s vs haproxy | p50 ms | p99 ms | p99 vs haproxy "
          "| proxy CPU % | user µs/req | sys µs/req | switches per 1k req (vol. / invol.) | proxy RSS MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, _, _, who in targets:
        rows = results[name]
        rps = [v[0] for v in rows]
        rss = "–" if not who else f"{sum(rss_kib(p) for p in family_pids(pids[who])) / 1024:.1f}"
        print(
            f"| {name} | {cell(rps, '{:.0f}')} | {statistics.median(rps) / direct * 100:.0f}% "
            f"| {versus(name, who, 0)} "
            f"| {cell([v[1] for v in rows], '{:.2f}')} | {cell([v[2] for v in rows], '{:.2f}')} "
            f"| {versus(name, who, 2)} "
            f"| {statistics.median(cpu[name]):.0f} "
            f"| {'–' if not who else f'{statistics.median(u for u, _ in per_req[name]):.1f}'} "
            f"| {'–' if not who else f'{statistics.median(s for _, s in per_req[name]):.1f}'} "
            f"| {'–' if not who else f'{statistics.median(v for v, _ in switches[name]):.0f} / {statistics.median(i for _, i in switches[name]):.0f}'} "
            f"| {rss} |"
        )
    # The comparisons the targets are judged by (docs/BENCHMARKS.md), each round's ratio
    # taken between runs seconds apart, with how sure the median of them is.
    pairs = [("sluice", "haproxy", 0, "req/s"), ("sluice", "haproxy", 2, "p99"),
             ("sluice", "haproxy-via", 0, "req/s"), ("haproxy-via", "haproxy", 0, "req/s"),
             ("sluice-off", "haproxy", 0, "req/s"), ("sluice", "sluice-off", 0, "req/s"),
             ("sluice-1", "haproxy-1", 0, "req/s"), ("sluice-1", "haproxy-1", 2, "p99"),
             ("baseline", "sluice", 0, "req/s")]
    lines = []
    for a, b, column, what in pairs:
        if a in names and b in names:
            ratios = [x[column] / y[column] for x, y in zip(results[names[a]], results[names[b]])]
            mid, low, high = median_interval(ratios)
            lines.append(f"- {names[a]} / {names[b]}, {what}: {mid * 100:.1f}% "
                         f"[{low * 100:.1f}–{high * 100:.1f}]")
    print("\nCPU µs per request, median over rounds, of each process the requests run through "
          "(the sum sets the rate: they share the machine's cores)\n")
    print("| target | proxy | client (wrk) | upstream (nginx) | stderr reader | all |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, _, _, who in targets:
        cols = list(zip(*machine[name]))
        med = [statistics.median(c) for c in cols] + [statistics.median(map(sum, machine[name]))]
        print(f"| {name} | " + " | ".join(
            "–" if (i == 0 and not who) or (i == 3 and who not in readers) else f"{v:.2f}"
            for i, v in enumerate(med)) + " |")
    if lines:
        print("\nRound-by-round ratios: median [95% bootstrap interval of the median]")
        print("\n".join(lines))
    print(f"\n{shipped.log_lines[0]} log lines read from the as-shipped instance's stderr so far",
          flush=True)


try:
    main()
finally:
    procs.stop_all()
    shutil.rmtree(work, ignore_errors=True)

"""Helpers shared by the bench scripts (and scripts/check-cost): processes started here
and stopped by PID, readiness polling, resident memory from /proc, and sluice under
callgrind with its dumps read."""

import glob
import os
import random
import re
import signal
import statistics
import subprocess
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# SLUICE_BIN=<another build> measures that build instead, e.g. an older commit's.
# Where cargo builds: CARGO_TARGET_DIR when set (relative to the repository, where the
# bench scripts run), else target/.
TARGET = os.path.join(ROOT, os.environ.get("CARGO_TARGET_DIR") or "target")
SLUICE = os.environ.get("SLUICE_BIN") or os.path.join(TARGET, "release", "sluice")


def require_binary(path):
    """Stops the bench with the reason when `path` is no executable: valgrind, or a
    readiness poll, would otherwise wait on a process that never started."""
    if not os.access(path, os.X_OK):
        raise SystemExit(f"{path}: no executable there; build it with "
                         "`cargo build --release`, or point SLUICE_BIN or BASELINE at one")


class Procs:
    def __init__(self):
        self.started = []

    def start(self, cmd, **kw):
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
        self.started.append(p)
        return p

    def stop(self, p):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()

    def stop_all(self):
        for p in self.started:
            self.stop(p)

    def check_alive(self):
        for p in self.started:
            if p.poll() is not None:
                raise SystemExit(f"{p.args[0]} exited at start (port in use?)")


def start_sluice(procs, config, log="shipped", extra_env=None, binary=SLUICE):
    """Starts sluice on `config` as users run it. `log="shipped"`: the default log level
    (an access line per request) with stderr read through a pipe by a thread here, as a
    container runtime reads it; `log="off"`: RUST_LOG=warn, no access lines (stderr still
    drained). Returns the process; `p.log_lines[0]` counts the lines read, `p.drain_tid` is
    the reading thread's id."""
    require_binary(binary)
    env = {**os.environ, **(extra_env or {})}
    env.pop("RUST_LOG", None)
    if log == "off":
        env["RUST_LOG"] = "warn"
    p = subprocess.Popen([binary, "run", "-c", config], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env=env)
    procs.started.append(p)
    p.log_lines = [0]

    def drain():
        p.drain_tid = threading.get_native_id()
        # In large reads, as a container runtime reads a pipe: reading line by line would
        # cost this process more CPU than sluice spends writing them.
        while chunk := p.stderr.read1(1 << 16):
            p.log_lines[0] += chunk.count(b"\n")

    threading.Thread(target=drain, daemon=True).start()
    return p


async def stalling_upstream(port):
    """An upstream on 127.0.0.1:`port` that accepts, reads, and never answers: the first
    request through a concurrency limit of one holds the permit, every later one queues."""
    import asyncio

    async def never_answer(reader, writer):
        try:
            await reader.read(65536)
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass

    return await asyncio.start_server(never_answer, "127.0.0.1", port)


def get(url, timeout=10):
    return urllib.request.urlopen(url, timeout=timeout).read().decode()


def wait_http(url):
    for _ in range(100):
        try:
            return get(url, timeout=2)
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"{url} never answered")


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_split(pids):
    """(user, system) CPU seconds so far of the given processes."""
    user = system = 0.0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            user += int(fields[11]) / os.sysconf("SC_CLK_TCK")
            system += int(fields[12]) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return user, system


def context_switches(pids):
    """(voluntary, involuntary) context switches so far of every thread of the given
    processes: a thread that sleeps when it has nothing to do, or one preempted by
    another runnable thread (on a saturated machine, its connections wait meanwhile)."""
    vol = invol = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                for line in open(f"/proc/{pid}/task/{t}/status"):
                    if line.startswith("voluntary_ctxt_switches:"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        invol += int(line.split()[1])
            except OSError:
                pass
    return vol, invol


def cpu_seconds(pids):
    """User + system CPU time so far of the given processes."""
    return sum(cpu_split(pids))


def _ms(value, unit):
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def wrk_argv(url, conns, seconds, script=None, threads=2):
    """wrk's command line for `url`: `threads` threads, `conns` connections, `seconds`
    long, with the Lua `script` when given."""
    return (["wrk", f"-t{threads}", f"-c{conns}", f"-d{seconds}s"] + (["-s", script] if script else [])
            + [url])


def wrk(url, conns, seconds, script=None, threads=2, count=False):
    """Runs wrk (2 threads unless told); returns (req/s, p50 ms, p99 ms), and with `count`
    also the number of requests wrk completed (for exact per-request counts). Any non-2xx
    aborts."""
    cmd = wrk_argv(url, conns, seconds, script, threads)
    cmd.insert(1, "--latency")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    lat = {p: _ms(v, u) for p, v, u in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)", out, re.M)}
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if bad:
        raise SystemExit(f"{url}: {bad.group(1)} non-2xx responses\n{out}")
    if count:
        return rps, lat["50"], lat["99"], int(re.search(r"(\d+) requests in", out).group(1))
    return rps, lat["50"], lat["99"]


def round_order(targets, r):
    """The order to measure `targets` in, in round `r`: a shuffle, the same for the same
    round on every run (BENCH_SEED changes it). A rotation would keep each target's
    neighbours: it would always follow the same one, so what a target leaves behind for
    a few seconds (with wrk -t1, targets measured right after tinyproxy ran at 93% of
    their own median, two places after at 97%) would always land on the same next ones
    and read as their cost."""
    order = list(targets)
    random.Random(f"{os.environ.get('BENCH_SEED', '0')}:{r}").shuffle(order)
    return order


def median_interval(values, level=0.95, resamples=2000):
    """The median of `values` and a bootstrap interval for it: the middle `level` of the
    medians of `resamples` samples drawn with replacement (a fixed seed, so a rerun on
    the same figures prints the same interval). With the machine's speed swinging by tens
    of percent, a median of a few rounds says little without it."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    cut = int(resamples * (1 - level) / 2)
    return statistics.median(values), medians[cut], medians[-cut - 1]


def family_pids(root):
    """The process and its children (nginx and squid work in child processes)."""
    out = subprocess.run(["pgrep", "-P", str(root)], capture_output=True, text=True).stdout.split()
    return [root] + [int(p) for p in out]


def hello_nginx(procs, work, ports, tls=None):
    """Starts nginx (one worker, keep-alive without limit) answering `200 hello` on each
    of `ports` on 127.0.0.1; over TLS with `tls=(certificate, key)`, PEM paths."""
    conf = os.path.join(work, "nginx.conf")
    ssl = " ssl" if tls else ""
    listens = "".join(f"    listen 127.0.0.1:{p}{ssl};\n" for p in ports)
    if tls:
        listens += f"    ssl_certificate {tls[0]};\n    ssl_certificate_key {tls[1]};\n"
    with open(conf, "w") as f:
        f.write(f"""
worker_processes 1;
daemon off;
pid {work}/nginx.pid;
error_log {work}/error.log;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  server {{
{listens}    location / {{ return 200 "hello\\n"; }}
  }}
}}
""")
    return procs.start(["nginx", "-c", conf, "-p", work])


def passthrough_config(work, listen, admin, matched_port):
    """A sluice config where 127.0.0.1:`matched_port` is an upstream whose one family pays
    a token bucket generous enough never to make anyone wait: what is measured is the
    cost of paying it. Any other host is unmatched and passes. Returns its path."""
    path = os.path.join(work, "sluice.toml")
    # The unmatched target is on loopback too, which the egress rules refuse unless
    # allowed; BENCH_NO_EGRESS=1 leaves the section out for a build from before them.
    egress = "" if os.environ.get("BENCH_NO_EGRESS") else '[egress]\nallow = ["127.0.0.1"]\n'
    with open(path, "w") as f:
        f.write(f"""
[proxy]
listen = "127.0.0.1:{listen}"
admin = "127.0.0.1:{admin}"
[[upstream]]
name = "bench"
hosts = ["127.0.0.1:{matched_port}"]
limits = [{{ kind = "token_bucket", rate = 100000000, per = "1s", burst = 100000000 }}]
  [[upstream.family]]
  name = "all"
  paths = ["/**"]
{egress}""")
    return path


def haproxy_config(work, name, port, upstream_port, threads, bind="", server="", frontend=()):
    """A haproxy config with its defaults (no log, `http-reuse safe`): `threads` threads
    listening on 127.0.0.1:`port` in front of 127.0.0.1:`upstream_port`; `bind` and
    `server` add options to those lines (TLS, say), `frontend` lines to its frontend.
    Returns its path."""
    rules = "".join(f"  {line}\n" for line in frontend)
    path = os.path.join(work, name)
    with open(path, "w") as f:
        f.write(f"""global
  nbthread {threads}
defaults
  mode http
  timeout connect 5s
  timeout client 30s
  timeout server 30s
frontend fe
  bind 127.0.0.1:{port} {bind}
{rules}  default_backend be
backend be
  server s1 127.0.0.1:{upstream_port} {server}
""")
    return path


def wait_slow(url):
    """`wait_http` for a process that starts slowly (under valgrind): up to a minute."""
    for _ in range(600):
        try:
            return wait_http(url)
        except SystemExit:
            time.sleep(0.1)
    raise SystemExit(f"{url} never answered")


def shipped_config(work, name, listen, admin):
    """The bundled config/sluice.toml as a user starts it, changed only where a benchmark
    must: its two ports, and loopback allowed as a destination (the upstreams here are on
    127.0.0.1, which the egress rules refuse by default). Returns its path."""
    text = open(os.path.join(ROOT, "config", "sluice.toml")).read()
    for old, new in [
        ('listen = "127.0.0.1:3128"', f'listen = "127.0.0.1:{listen}"'),
        ('admin = "127.0.0.1:9901"', f'admin = "127.0.0.1:{admin}"'),
        ("allow = []", 'allow = ["127.0.0.1"]'),
    ]:
        if old not in text:
            raise SystemExit(f"config/sluice.toml no longer has {old!r}: update shipped_config")
        text = text.replace(old, new, 1)
    path = os.path.join(work, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def absolute_form_script(work, port):
    """A wrk script sending absolute-form request lines for 127.0.0.1:`port`, as a client
    configured with HTTP_PROXY does: with `Host` naming the target, as RFC 9112 §3.2 has a
    client send it (wrk alone would name the proxy). Returns its path."""
    path = os.path.join(work, f"absolute-{port}.lua")
    with open(path, "w") as f:
        f.write(f'wrk.path = "http://127.0.0.1:{port}/"\n')
        f.write(f'wrk.headers["Host"] = "127.0.0.1:{port}"\n')
    return path


def shipped_off_haproxy(procs, work, upstream_port, ports):
    """The three instances bench/syscalls and bench/switches compare, in front of
    127.0.0.1:`upstream_port`: sluice as shipped, sluice with the log off (each on the
    shipped config, see `shipped_config`) and haproxy with 2 threads. `ports`: the first
    sluice's listen and admin ports, the second's, and haproxy's. Returns (name, url, wrk
    script, process) for each, ready."""
    shipped, shipped_admin, off, off_admin, haproxy = ports
    targets = []
    for name, port, admin, log in [("sluice as shipped", shipped, shipped_admin, "shipped"),
                                   ("sluice, log off", off, off_admin, "off")]:
        p = start_sluice(procs, shipped_config(work, f"{log}.toml", port, admin), log=log)
        wait_http(f"http://127.0.0.1:{admin}/readyz")
        targets.append((name, f"http://127.0.0.1:{port}/", absolute_form_script(work, upstream_port), p))
    h = procs.start(["haproxy", "-db", "-f", haproxy_config(work, "h.cfg", haproxy, upstream_port, 2)])
    time.sleep(1)
    targets.append(("haproxy, 2 threads", f"http://127.0.0.1:{haproxy}/", None, h))
    procs.check_alive()
    return targets


# The C allocator's entry points: calls into them are the allocations a dump counts.
ALLOCATORS = {"malloc", "calloc", "realloc", "aligned_alloc", "posix_memalign", "memalign"}


def start_under_callgrind(procs, work, config, binary=SLUICE, extra_env=None):
    """Starts `binary run -c config` under callgrind (dumps in `work`/cg.out.<n>) as
    shipped, one worker: the default log level, stderr drained through a pipe. Returns
    the process."""
    env = {**os.environ, "SLUICE_WORKERS": "1", **(extra_env or {})}
    env.pop("RUST_LOG", None)
    p = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={work}/cg.out", binary, "run",
                          "-c", config], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    procs.started.append(p)
    threading.Thread(target=lambda: [None for _ in iter(lambda: p.stderr.read1(1 << 16), b"")],
                     daemon=True).start()
    return p


def callgrind_dump(work, pid):
    """Dumps what process `pid` counted since its counters were last zeroed
    (`callgrind_control -z`); returns the dump's path."""
    for f in glob.glob(os.path.join(work, "cg.out.*")):
        os.remove(f)
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    for _ in range(200):
        dumps = glob.glob(os.path.join(work, "cg.out.*"))
        if dumps:
            # Written by then, but perhaps not closed: a moment more.
            time.sleep(0.5)
            return max(dumps, key=os.path.getmtime)
        time.sleep(0.1)
    raise SystemExit(f"callgrind wrote no dump for {pid} in {work}")


def callgrind_counts(path):
    """Total instructions, and calls into the allocator, of a callgrind dump."""
    names, total, allocs, callee = {}, 0, 0, None
    for line in open(path, errors="replace"):
        if line.startswith(("summary:", "totals:")):
            total = int(line.split()[1])
        elif line.startswith(("cfn=", "fn=")):
            m = re.match(r"c?fn=(?:\((\d+)\))?\s*(.*)", line.rstrip("\n"))
            if m.group(2):
                names[m.group(1)] = m.group(2)
            if line.startswith("cfn="):
                callee = names.get(m.group(1), m.group(2))
        elif line.startswith("calls=") and callee is not None:
            if re.sub(r"'\d+$", "", callee) in ALLOCATORS:
                allocs += int(line.split("=", 1)[1].split()[0])
            callee = None
    return total, allocs

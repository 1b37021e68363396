"""Runs the shaping benchmark (see shaping.sh) and prints a Markdown table.

The upstream is nginx with `limit_req` at 50 r/s (burst 10, nodelay), serving a file
through try_files so the limit applies; excess requests get 429. sluice holds a token
bucket of 48/s with the same burst in front of it. wrk drives 40 connections.

nginx logs each request's time and status; the per-second counts of both runs go to
bench/out/shaping.csv, which bench/plot_shaping.py draws.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from common import ROOT, SLUICE, Procs, get, wait_http

SECONDS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
CONNS = 40
NGINX_PORT, PROXY_PORT, ADMIN_PORT = 18100, 13148, 19921
RATE, BURST, SLUICE_RATE = 50, 10, 48
work = tempfile.mkdtemp(prefix="sluice-shape-")
procs = Procs()


def wrk(url, script=None):
    cmd = ["wrk", "-t2", f"-c{CONNS}", f"-d{SECONDS}s", "--timeout", "60s"]
    if script:
        cmd += ["-s", script]
    out = subprocess.run(cmd + [url], capture_output=True, text=True, check=True).stdout
    total = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return total, int(non2xx.group(1)) if non2xx else 0


def main():
    os.chmod(work, 0o755)  # nginx's workers run as nobody and must read the files
    www = os.path.join(work, "www")
    os.makedirs(www)
    with open(os.path.join(www, "item.json"), "w") as f:
        f.write('{"ok": true}\n')
    conf = os.path.join(work, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"""worker_processes 1; daemon off; pid {work}/nginx.pid; error_log {work}/error.log;
events {{ worker_connections 1024; }}
http {{
  log_format t '$msec $status';
  access_log {work}/access.log t buffer=256k flush=1s;
  limit_req_zone $server_name zone=api:1m rate={RATE}r/s;
  server {{
    listen 127.0.0.1:{NGINX_PORT};
    server_name api;
    root {www};
    location / {{
      limit_req zone=api burst={BURST} nodelay;
      limit_req_status 429;
      try_files $uri =404;
    }}
  }}
}}
""")
    procs.start(["nginx", "-c", conf, "-p", work])
    sconf = os.path.join(work, "sluice.toml")
    with open(sconf, "w") as f:
        f.write(f"""[proxy]
listen = "127.0.0.1:{PROXY_PORT}"
admin = "127.0.0.1:{ADMIN_PORT}"
[[upstream]]
name = "api"
hosts = ["127.0.0.1:{NGINX_PORT}"]
limits = [{{ kind = "token_bucket", rate = {SLUICE_RATE}, per = "1s", burst = {BURST} }}]
""")
    procs.start([SLUICE, "run", "-c", sconf], env={**os.environ, "RUST_LOG": "warn"})
    wait_http(f"http://127.0.0.1:{ADMIN_PORT}/readyz")
    url = f"http://127.0.0.1:{NGINX_PORT}/item.json"
    wait_http(url)
    time.sleep(1)  # let nginx's bucket drain the probe
    script = os.path.join(work, "proxy.lua")
    with open(script, "w") as f:
        f.write(f'wrk.path = "{url}"\nwrk.headers["Host"] = "127.0.0.1:{NGINX_PORT}"\n')

    nginx = procs.started[0]
    log = os.path.join(work, "access.log")

    def rotate(name):
        """Moves the log aside and has nginx reopen it; returns the moved file."""
        time.sleep(1.5)  # the buffer flushes every second
        moved = os.path.join(work, name)
        os.rename(log, moved)
        nginx.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        return moved

    rotate("warmup.log")
    direct_start = time.time()
    direct_total, direct_429 = wrk(url)
    direct_log = rotate("direct.log")
    sluice_start = time.time()
    total, non2xx = wrk(f"http://127.0.0.1:{PROXY_PORT}", script)
    sluice_log = rotate("sluice.log")
    write_csv([("direct", direct_log, direct_start), ("sluice", sluice_log, sluice_start)])
    metrics = get(f"http://127.0.0.1:{ADMIN_PORT}/metrics")
    up429 = sum(int(v) for v in re.findall(r'sluice_upstream_responses_total\{[^}]*status="429"[^}]*\} (\d+)', metrics))
    ok = total - non2xx
    configured = SLUICE_RATE * SECONDS + BURST
    print(f"\nwrk -t2 -c{CONNS} -d{SECONDS}s against nginx limit_req {RATE} r/s (burst {BURST});"
          f" sluice token_bucket {SLUICE_RATE}/s burst {BURST}\n")
    print("| path | 200s | 200/s | of sluice's rate | upstream 429s |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| direct | {direct_total - direct_429} | {(direct_total - direct_429) / SECONDS:.1f} | – | {direct_429} |")
    print(f"| through sluice | {ok} | {ok / SECONDS:.1f} | {ok / configured * 100:.1f}% | {up429} |")
    if non2xx != up429:
        print(f"\n(other non-2xx through sluice: {non2xx - up429})")


def write_csv(runs):
    """Per-second counts of 200s and 429s seen by the upstream, for each run."""
    out = os.path.join(ROOT, "bench", "out")
    os.makedirs(out, exist_ok=True)
    rows = []
    for name, path, start in runs:
        counts = {}
        with open(path) as f:
            for line in f:
                t, status = line.split()
                second = int(float(t) - start)
                if 0 <= second < SECONDS:
                    c = counts.setdefault(second, [0, 0])
                    c[0 if status == "200" else 1] += 1
        for second in range(SECONDS):
            ok, limited = counts.get(second, [0, 0])
            rows.append(f"{name},{second},{ok},{limited}")
    with open(os.path.join(out, "shaping.csv"), "w") as f:
        f.write(f"# provider_rate={RATE} sluice_rate={SLUICE_RATE} burst={BURST} connections={CONNS}\n")
        f.write("run,second,ok,rejected_429\n" + "\n".join(rows) + "\n")
    print(f"per-second counts: {os.path.relpath(os.path.join(out, 'shaping.csv'), ROOT)}")


try:
    main()
finally:
    procs.stop_all()
    shutil.rmtree(work, ignore_errors=True)

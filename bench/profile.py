"""Where a proxied request's CPU goes, sluice and haproxy side by side (see profile.sh):
sluice as shipped, sluice with the log off and haproxy (2 threads) in front of the same
nginx, each loaded in turn by wrk -t1 -c32 through the matched upstream, while
`perf record -e cpu-clock` samples the proxy's threads. Prints per target the rate,
CPU microseconds per request, the share of samples in the kernel, page faults per
request, and the functions with the most samples of their own."""

import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Procs, cpu_seconds, hello_nginx, shipped_off_haproxy  # noqa: E402

SECONDS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
TOP = int(sys.argv[2]) if len(sys.argv) > 2 else 12
UPSTREAM = 18120
PORTS = [13180, 19980, 13181, 19981, 13182]


def main():
    procs = Procs()
    work = tempfile.mkdtemp(prefix="sluice-profile-")
    try:
        hello_nginx(procs, work, [UPSTREAM])
        targets = shipped_off_haproxy(procs, work, UPSTREAM, PORTS)
        for name, url, script, p in targets:
            wrk = ["wrk", "-t1", "-c32", f"-d{SECONDS + 2}s"] + (["-s", script] if script else []) + [url]
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
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)


main()

"""Helpers shared by the bench scripts: processes started here and stopped by PID,
readiness polling, and resident memory from /proc."""

import os
import signal
import subprocess
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLUICE = os.path.join(ROOT, "target", "release", "sluice")


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

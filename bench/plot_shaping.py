"""Draws bench/out/shaping.csv (written by bench/shaping.sh) as docs/shaping.png:
requests the upstream admitted per second against the configured limit, and the 429s it
answered, through sluice and sent directly.

Usage: /usr/bin/python3 bench/plot_shaping.py [csv] [png]
Needs matplotlib: Debian's python3-matplotlib, which bench/prepare.sh installs.
"""

import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "bench", "out", "shaping.csv")
dst = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "docs", "shaping.png")

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

with open(src) as f:
    header = dict(kv.split("=") for kv in f.readline().lstrip("# ").split())
    rows = list(csv.DictReader(f))
provider, configured = int(header["provider_rate"]), int(header["sluice_rate"])
runs = {}
for r in rows:
    run = runs.setdefault(r["run"], ([], [], []))
    run[0].append(int(r["second"]))
    run[1].append(int(r["ok"]))
    run[2].append(int(r["rejected_429"]))

fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
t, ok, rejected = runs["sluice"]
top.step(t, ok, where="post", label="admitted by the upstream (200/s)", color="tab:blue", lw=2.5)
top.step(t, rejected, where="post", label="upstream 429s per second", color="tab:red")
top.axhline(configured, ls="--", color="tab:green", label=f"sluice limit {configured}/s")
top.axhline(provider, ls=":", color="gray", label=f"provider limit {provider}/s")
top.set_ylim(0, provider * 1.4)
top.set_ylabel("requests per second")
top.set_title(f"Through sluice ({header['connections']} connections): {sum(rejected)} upstream 429s")
top.legend(loc="lower right", fontsize=8)

t, ok, rejected = runs["direct"]
bottom.step(t, [max(v, 0.5) for v in ok], where="post", label="200/s", color="tab:blue")
bottom.step(t, [max(v, 0.5) for v in rejected], where="post", label="429/s", color="tab:red")
bottom.axhline(provider, ls=":", color="gray", label=f"provider limit {provider}/s")
bottom.set_yscale("log")
bottom.set_ylabel("requests per second (log)")
bottom.set_xlabel("seconds into the run")
bottom.set_title(f"Sent directly: {sum(rejected):,} upstream 429s")
bottom.legend(loc="center right", fontsize=8)

fig.tight_layout()
fig.savefig(dst, dpi=100)
print(f"wrote {os.path.relpath(dst, ROOT)}")

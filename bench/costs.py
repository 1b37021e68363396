"""Runs the costs benchmark (see costs.sh) and prints Markdown tables.

Pricing: wrk POSTs the same 4 KiB chat-completion body through sluice to nginx, to an
upstream whose family prices it with the "openai" estimator and to one that does not,
both paying a request limit too large to wait on; interleaved rounds, medians.

Budgets: ten clients send a mixed workload (prompts of 100 to 8,000 characters,
max_tokens of 100 to 2,000) through sluice, as docs/config.md's OpenAI and Anthropic
examples configure it, to a provider allowing BUDGET tokens a minute. The share of the
budget used is what the provider charged (OpenAI-style) or what the replies produced
(Anthropic-style), against what a window of BUDGET a minute allows from the first answer
to the last: BUDGET at once, then BUDGET a minute.
"""

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from common import Procs, cpu_seconds, hello_nginx, start_sluice, wait_http, wrk

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
SECONDS = int(sys.argv[2]) if len(sys.argv) > 2 else 10
MINUTES = float(sys.argv[3]) if len(sys.argv) > 3 else 4
# "pricing", "budgets" or both.
PARTS = sys.argv[4] if len(sys.argv) > 4 else "all"
PLAIN, PRICED = 18090, 18091
PROXY, ADMIN = 13140, 19940
PROVIDER = 18092
BUDGET = 100_000
CLIENTS = 10
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

work = tempfile.mkdtemp(prefix="sluice-bench-")
procs = Procs()
# Stopped with SIGTERM, it still stops what it started (the finally below).
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))


def body_4k():
    text = ("The quick brown fox jumps over the lazy dog. " * 100)[:3900]
    return json.dumps({
        "model": "gpt-4o-mini",
        "max_tokens": 500,
        "messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": text}],
    })


def post_script(port, body):
    path = os.path.join(work, f"post-{port}.lua")
    with open(path, "w") as f:
        f.write(f'wrk.method = "POST"\nwrk.path = "http://127.0.0.1:{port}/v1/chat/completions"\n')
        f.write(f'wrk.headers["Host"] = "127.0.0.1:{port}"\n')
        f.write('wrk.headers["Content-Type"] = "application/json"\n')
        f.write(f"wrk.body = {json.dumps(body)}\n")
    return path


def pricing():
    hello_nginx(procs, work, [PLAIN, PRICED])
    conf = os.path.join(work, "pricing.toml")
    big = 'rate = 4000000000, per = "1s", burst = 4000000000'
    with open(conf, "w") as f:
        f.write(f"""
[proxy]
listen = "127.0.0.1:{PROXY}"
admin = "127.0.0.1:{ADMIN}"
[[upstream]]
name = "plain"
hosts = ["127.0.0.1:{PLAIN}"]
  [[upstream.family]]
  name = "chat"
  limits = [{{ kind = "token_bucket", {big} }}]
[[upstream]]
name = "priced"
hosts = ["127.0.0.1:{PRICED}"]
  [[upstream.family]]
  name = "chat"
  limits = [
    {{ kind = "token_bucket", {big} }},
    {{ kind = "token_bucket", {big}, unit = "tokens" }},
  ]
  [upstream.family.cost.tokens]
  estimate = "openai"
""")
    p = start_sluice(procs, conf)
    wait_http(f"http://127.0.0.1:{ADMIN}/readyz")
    body = body_4k()
    targets = [("unpriced family", post_script(PLAIN, body)), ("priced by the openai estimator", post_script(PRICED, body))]
    url = f"http://127.0.0.1:{PROXY}"
    for _, s in targets:
        wrk(url, 32, 2, s)
    results = {n: [] for n, _ in targets}
    cpu = {n: [] for n, _ in targets}
    for r in range(ROUNDS):
        for name, s in targets:
            before = cpu_seconds([p.pid])
            results[name].append(wrk(url, 32, SECONDS, s))
            cpu[name].append((cpu_seconds([p.pid]) - before) / SECONDS * 100)
            print(f"round {r + 1} {name}: {results[name][-1][0]:.0f} req/s", file=sys.stderr)
    plain = statistics.median(v[0] for v in results["unpriced family"])
    print(f"\nPOST of a {len(body)}-byte chat body, wrk -t2 -c32 -d{SECONDS}s, {ROUNDS} rounds interleaved; median (min–max)\n")
    print("| target | req/s | % of unpriced | p99 ms | sluice CPU % |")
    print("| --- | --- | --- | --- | --- |")
    for name, _ in targets:
        rps = [v[0] for v in results[name]]
        print(f"| {name} | {statistics.median(rps):.0f} ({min(rps):.0f}–{max(rps):.0f}) "
              f"| {statistics.median(rps) / plain * 100:.0f}% | {statistics.median(v[2] for v in results[name]):.2f} "
              f"| {statistics.median(cpu[name]):.0f} |")
    procs.stop(p)


def budget_config(path, kind):
    upstream = f"""
[proxy]
listen = "127.0.0.1:{PROXY + 1}"
admin = "127.0.0.1:{ADMIN + 1}"
[[upstream]]
name = "llm"
hosts = ["127.0.0.1:{PROVIDER}"]
"""
    if kind == "openai":
        family = f"""
  [[upstream.family]]
  name = "chat"
  paths = ["/v1/chat/completions"]
  max_wait = "2m"
  limits = [{{ kind = "sliding_window", permits = {BUDGET}, window = "1m", unit = "tokens" }}]
  [upstream.family.cost.tokens]
  estimate = "openai"
"""
    else:
        family = f"""
  [[upstream.family]]
  name = "messages"
  paths = ["/v1/messages"]
  max_wait = "2m"
  limits = [{{ kind = "sliding_window", permits = {BUDGET}, window = "1m", unit = "output_tokens" }}]
  [upstream.family.cost.output_tokens]
  estimate = "anthropic:output"
  actual = "json:/usage/output_tokens"
"""
    with open(path, "w") as f:
        f.write(upstream + family)


def budget(kind):
    provider = procs.start(["python3", os.path.join(ROOT, "tests/fixtures/llm_provider.py"), str(PROVIDER), str(BUDGET), "60"])
    conf = os.path.join(work, f"{kind}.toml")
    budget_config(conf, kind)
    p = start_sluice(procs, conf)
    wait_http(f"http://127.0.0.1:{ADMIN + 1}/readyz")
    time.sleep(1)
    path = "/v1/chat/completions" if kind == "openai" else "/v1/messages"
    proxy = urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{PROXY + 1}"})
    opener = urllib.request.build_opener(proxy)
    start = time.monotonic()
    end = start + MINUTES * 60
    log = []  # (answered, status, provider cost), seconds from the start
    lock = threading.Lock()

    def client(c):
        rng = random.Random(c)
        while time.monotonic() < end:
            chars, most = rng.randint(100, 8000), rng.randint(100, 2000)
            body = {"model": "m", "max_tokens": most, "messages": [{"role": "user", "content": "a" * chars}]}
            req = urllib.request.Request(f"http://127.0.0.1:{PROVIDER}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with opener.open(req, timeout=180) as r:
                    reply = json.loads(r.read())
                    status = r.status
            except urllib.error.HTTPError as e:
                status, reply = e.code, {}
            cost = (chars + 3) // 4 + most if kind == "openai" else reply.get("usage", {}).get("output_tokens", 0)
            with lock:
                log.append((time.monotonic() - start, status, cost))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{PROVIDER}/stats").read())
    procs.stop(p)
    procs.stop(provider)
    # What a sliding window of BUDGET a minute lets through from the first answer to the
    # last: one window's worth at once, then BUDGET a minute.
    answered = [s for s, st, _ in log if st == 200]
    span = max(answered) - min(answered)
    used = sum(c for _, st, c in log if st == 200) / (BUDGET * (1 + span / 60))
    # Minute by minute: what each minute-long window inside the run spent, over the
    # budget, averaged over windows starting every second from the first answer.
    first = min(answered)
    spent = sorted((s, c) for s, st, c in log if st == 200)
    shares = []
    t = first
    while t + 60 <= max(answered):
        shares.append(sum(c for s, c in spent if t <= s < t + 60) / BUDGET)
        t += 1
    per_minute = sum(shares) / len(shares) if shares else float("nan")
    ok = sum(1 for _, st, _ in log if st == 200)
    refused = stats["refused"]
    return ok, refused, used, per_minute


def main():
    if PARTS in ("all", "pricing"):
        pricing()
    if PARTS not in ("all", "budgets"):
        return
    print(f"\n{CLIENTS} clients, prompts of 100–8,000 characters, max_tokens 100–2,000, "
          f"a budget of {BUDGET:,} tokens a minute, {MINUTES:g} minutes; budget used against BUDGET + BUDGET a minute from the first answer to the last\n")
    print("| provider | requests answered | provider 429s | budget used | each minute's budget used (mean) |")
    print("| --- | --- | --- | --- | --- |")
    for kind, label in [("openai", "OpenAI-style: estimate charged at arrival (limits, cost=)"),
                        ("anthropic", "Anthropic-style: output tokens reconciled, produced tokens counted")]:
        ok, refused, used, per_minute = budget(kind)
        print(f"| {label} | {ok} | {refused} | {used * 100:.1f}% | {per_minute * 100:.1f}% |", flush=True)


try:
    main()
finally:
    procs.stop_all()
    shutil.rmtree(work, ignore_errors=True)

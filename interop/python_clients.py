"""Real Python HTTP clients through sluice, as users configure them: requests, httpx
(HTTP/1.1 and HTTP/2), urllib, aiohttp, websockets and websocket-client, each in the
three modes (forward
proxy for http://, interception and a blind tunnel for https://).

Run by tests/interop.rs with one argument, a JSON plan (proxy URL, sluice's CA, the
upstreams' CA, a base URL and a WebSocket URL per mode). Prints one JSON line per check:
{"client", "mode", "check", "ok", "detail"}. Every check runs; the test asserts them.
"""

import asyncio
import hashlib
import json
import os
import ssl
import sys
import time
import urllib.parse
import urllib.request
import uuid

import aiohttp
import httpx
import requests
import websocket  # websocket-client
import websockets

plan = json.load(open(sys.argv[1]))
PROXY = plan["proxy"]
# Intercepted: the client must trust sluice's CA. Tunnelled: the upstream's own.
CA = {"forward": None, "intercept": plan["sluice_ca"], "tunnel": plan["upstream_ca"]}
MB = os.urandom(1 << 20)
MB_SHA = hashlib.sha256(MB).hexdigest()


def report(client, mode, check, ok, detail=""):
    print(json.dumps({"client": client, "mode": mode, "check": check, "ok": bool(ok),
                      "detail": str(detail)[:300]}), flush=True)


def run(client, mode, check, fn):
    try:
        ok, detail = fn()
    except Exception as e:  # a failed check, not a failed suite
        ok, detail = False, f"{type(e).__name__}: {e}"
    report(client, mode, check, ok, detail)


def inspected(text):
    v = json.loads(text)
    return v


def chunks():
    for i in range(0, len(MB), 64 << 10):
        yield MB[i:i + (64 << 10)]


def sync_suite(client, mode, base, get, post, head, stream_first_chunk):
    """The checks every synchronous client runs; `get`/`post`/`head` return
    (status, headers, body bytes)."""
    def intact():
        s, h, b = post(f"{base}/inspect/a/b?q=1", b"hello", {"X-Interop": "yes", "Content-Type": "text/plain"})
        v = inspected(b)
        ok = (s == 200 and v["method"] == "POST" and v["path"] == "/inspect/a/b" and v["query"] == "q=1"
              and v["headers"].get("x-interop") == "yes" and v["body_len"] == 5)
        return ok, v
    run(client, mode, "method, path, headers and body intact", intact)

    def keepalive():
        results = [get(f"{base}/inspect/k{i}")[0] for i in range(3)]
        return results == [200, 200, 200], results
    run(client, mode, "keep-alive", keepalive)

    def upload():
        s, h, b = post(f"{base}/inspect/upload", MB, {})
        v = inspected(b)
        return s == 200 and v["body_sha256"] == MB_SHA, v["body_len"]
    run(client, mode, "1 MiB upload", upload)

    def chunked():
        s, h, b = post(f"{base}/inspect/chunked", chunks(), {})
        v = inspected(b)
        return s == 200 and v["body_sha256"] == MB_SHA, (v["body_len"], v["headers"].get("transfer-encoding"))
    run(client, mode, "chunked upload", chunked)

    def head_204_304():
        got = (head(f"{base}/inspect/h")[0], get(f"{base}/status/204")[0], get(f"{base}/status/304")[0])
        return got == (200, 204, 304), got
    run(client, mode, "HEAD, 204, 304", head_204_304)

    def streaming():
        first, total = stream_first_chunk(f"{base}/drip/4/300")
        return first < 0.8 * total, f"first chunk after {first:.2f} s of {total:.2f} s"
    run(client, mode, "streamed response", streaming)

    def retries():
        if mode == "tunnel":
            # Inside a blind tunnel sluice sees bytes, not requests: nothing to retry.
            s, h, _ = get(f"{base}/seq/{uuid.uuid4().hex}/429,200")
            return s == 429 and "sluice-attempts" not in h, (s, h.get("sluice-attempts"))
        name = uuid.uuid4().hex
        g = get(f"{base}/seq/{name}g/429,200")
        p = post(f"{base}/seq/{name}p/429,200", b"order", {})
        ok = g[0] == 200 and g[1].get("sluice-attempts") == "2" and p[0] == 429
        return ok, (g[0], g[1].get("sluice-attempts"), p[0])
    check = ("a 429 passed through as sent" if mode == "tunnel"
             else "429 retried for GET, not for a POST without a key")
    run(client, mode, check, retries)


def requests_suite(mode, base):
    s = requests.Session()
    s.proxies = {"http": PROXY, "https": PROXY}
    # Given with each request: REQUESTS_CA_BUNDLE in the environment (set on many
    # machines) takes precedence over a session's `verify`, as requests documents.
    verify = CA[mode] or True

    def get(u):
        r = s.get(u, timeout=30, verify=verify)
        return r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content

    def post(u, body, headers):
        r = s.post(u, data=body, headers=headers, timeout=30, verify=verify)
        return r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content

    def head(u):
        r = s.head(u, timeout=30, verify=verify)
        return r.status_code, r.headers, r.content

    def first_chunk(u):
        t = time.monotonic()
        r = s.get(u, stream=True, timeout=30, verify=verify)
        it = r.iter_content(chunk_size=None)
        next(it)
        first = time.monotonic() - t
        for _ in it:
            pass
        return first, time.monotonic() - t

    sync_suite("requests", mode, base, get, post, head, first_chunk)


def httpx_suite(mode, base, http2):
    name = "httpx (HTTP/2)" if http2 else "httpx"
    c = httpx.Client(proxy=PROXY, verify=ssl.create_default_context(cafile=CA[mode]) if CA[mode] else True,
                     http2=http2, timeout=30)

    def get(u):
        r = c.get(u)
        return r.status_code, dict(r.headers), r.content

    def post(u, body, headers):
        r = c.post(u, content=body, headers=headers)
        return r.status_code, dict(r.headers), r.content

    def head(u):
        r = c.head(u)
        return r.status_code, dict(r.headers), r.content

    def first_chunk(u):
        t = time.monotonic()
        with c.stream("GET", u) as r:
            it = r.iter_raw()
            next(it)
            first = time.monotonic() - t
            for _ in it:
                pass
        return first, time.monotonic() - t

    sync_suite(name, mode, base, get, post, head, first_chunk)
    if http2 and mode == "intercept":
        def spoke_h2():
            r = c.get(f"{base}/inspect/v")
            return r.http_version == "HTTP/2", r.http_version
        run(name, mode, "HTTP/2 inside the tunnel", spoke_h2)


def urllib_suite(mode, base):
    handlers = [urllib.request.ProxyHandler({"http": PROXY, "https": PROXY})]
    if CA[mode]:
        handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=CA[mode])))
    opener = urllib.request.build_opener(*handlers)

    def call(method, u, body=None, headers=None):
        req = urllib.request.Request(u, data=body, method=method, headers=headers or {})
        try:
            with opener.open(req, timeout=30) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
        except urllib.error.HTTPError as e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()

    def first_chunk(u):
        t = time.monotonic()
        with opener.open(u, timeout=30) as r:
            r.read1(65536)
            first = time.monotonic() - t
            r.read()
        return first, time.monotonic() - t

    sync_suite("urllib", mode, base, lambda u: call("GET", u), lambda u, b, h: call("POST", u, b, h),
               lambda u: call("HEAD", u), first_chunk)


async def aiohttp_suite(mode, base, ws):
    ctx = ssl.create_default_context(cafile=CA[mode]) if CA[mode] else None
    async with aiohttp.ClientSession() as s:
        async def intact():
            async with s.post(f"{base}/inspect/a?q=1", data=b"hello", headers={"X-Interop": "yes"},
                              proxy=PROXY, ssl=ctx) as r:
                v = json.loads(await r.read())
                return r.status == 200 and v["headers"].get("x-interop") == "yes" and v["body_len"] == 5, v
        async def upload():
            async def gen():
                for c in chunks():
                    yield c
            async with s.post(f"{base}/inspect/chunked", data=gen(), proxy=PROXY, ssl=ctx) as r:
                v = json.loads(await r.read())
                return v["body_sha256"] == MB_SHA, v["body_len"]
        async def websocket():
            async with s.ws_connect(ws, proxy=PROXY, ssl=ctx) as w:
                await w.send_str("hello")
                m = await asyncio.wait_for(w.receive(), 10)
                return m.data == "hello", m
        for check, fn in [("method, path, headers and body intact", intact), ("chunked upload", upload),
                          ("WebSocket", websocket)]:
            try:
                ok, detail = await fn()
            except Exception as e:
                ok, detail = False, f"{type(e).__name__}: {e}"
            report("aiohttp", mode, check, ok, detail)


async def websockets_suite(mode, ws):
    ctx = ssl.create_default_context(cafile=CA[mode]) if CA[mode] else None
    try:
        kw = {"ssl": ctx} if ws.startswith("wss") else {}
        async with websockets.connect(ws, proxy=PROXY, open_timeout=10, **kw) as w:
            await w.send("hello")
            got = await asyncio.wait_for(w.recv(), 10)
            await w.send(b"\x00\x01")
            got_b = await asyncio.wait_for(w.recv(), 10)
            report("websockets", mode, "WebSocket", got == "hello" and got_b == b"\x00\x01", (got, got_b))
    except Exception as e:
        report("websockets", mode, "WebSocket", False, f"{type(e).__name__}: {e}")


def websocket_client_suite(mode, ws):
    """websocket-client opens a CONNECT tunnel for ws:// as for wss://: in forward mode
    sluice finds the plain handshake in the tunnel and serves it, limits included."""
    proxy = urllib.parse.urlsplit(PROXY)
    try:
        sslopt = {"ca_certs": CA[mode]} if CA[mode] else {}
        # Its default no_proxy is localhost and 127.0.0.1 (an empty list falls back to
        # it): name a host that matches nothing, so that it goes through sluice.
        w = websocket.create_connection(ws, http_proxy_host=proxy.hostname,
                                        http_proxy_port=proxy.port, proxy_type="http",
                                        http_no_proxy=["nothing.invalid"],
                                        timeout=10, sslopt=sslopt)
        w.send("hello")
        got = w.recv()
        w.send_binary(b"\x00\x01")
        got_b = w.recv()
        w.close()
        report("websocket-client", mode, "WebSocket through CONNECT",
               got == "hello" and got_b == b"\x00\x01", (got, got_b))
    except Exception as e:
        report("websocket-client", mode, "WebSocket through CONNECT", False,
               f"{type(e).__name__}: {e}")


def refusal():
    """sluice's own answer, readable: a destination the egress rules refuse."""
    r = requests.get(plan["denied_url"], proxies={"http": PROXY}, timeout=30)
    v = r.json()
    report("requests", "forward", "sluice's refusal readable", r.status_code == 403
           and r.headers.get("sluice-reason") == "denied" and v["error"]["code"] == "sluice_denied", v)


for mode, m in plan["modes"].items():
    requests_suite(mode, m["base"])
    httpx_suite(mode, m["base"], http2=False)
    if mode != "forward":
        httpx_suite(mode, m["base"], http2=True)
    urllib_suite(mode, m["base"])
    asyncio.run(aiohttp_suite(mode, m["base"], m["ws"]))
    asyncio.run(websockets_suite(mode, m["ws"]))
    websocket_client_suite(mode, m["ws"])
refusal()

"""Which hosts each client sends through the proxy and which it calls directly, with the
proxy variables set as the shipped manifests set them: curl, wget, and Python's urllib,
requests, httpx and aiohttp, each deciding with its own code.

Run by tests/interop.rs with one argument, a JSON plan: the proxy URL, the NO_PROXY value
and the hosts to try. Nothing leaves loopback: curl and wget are bound to 127.0.0.1, so
a direct connection to another address fails at connect(2) before a packet is sent (and
one to loopback meets the closed discard port); Python's connections and name lookups
are intercepted in the process. Each request's path names its client, so the proxy's
access log can say which ones it received. Prints one JSON line per (client, host): {"client", "host", "via"},
`via` being "proxy", "direct" or "error: ...".
"""

import asyncio
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from urllib.parse import urlsplit

plan = json.load(open(sys.argv[1]))
PROXY = plan["proxy"]
HOSTS = plan["hosts"]
ENV = {
    "http_proxy": PROXY, "HTTP_PROXY": PROXY, "https_proxy": PROXY, "HTTPS_PROXY": PROXY,
    "no_proxy": plan["no_proxy"], "NO_PROXY": plan["no_proxy"],
}
os.environ.update(ENV)


proxy_at = urlsplit(PROXY)
PROXY_ADDR = (proxy_at.hostname, proxy_at.port)
# (client, host) pairs whose client opened a connection anywhere but the proxy.
went_direct = set()
current = [None]

# Python's clients: every connection is opened through socket.socket.connect (asyncio's
# too), and every name resolved through socket.getaddrinfo. A name other than the proxy's
# resolves to the discard port on loopback (no DNS query leaves), and a connection to
# anything but the proxy is noted and refused before a packet is sent.
_getaddrinfo = socket.getaddrinfo
_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex


def loopback_only(host, port, *args, **kwargs):
    if (host, str(port)) == (PROXY_ADDR[0], str(PROXY_ADDR[1])):
        return _getaddrinfo(host, port, *args, **kwargs)
    return _getaddrinfo("127.0.0.1", 9, socket.AF_INET, socket.SOCK_STREAM)


def guarded(sock, address):
    if tuple(address[:2]) != PROXY_ADDR:
        went_direct.add(current[0])
        raise ConnectionRefusedError(f"a direct connection to {address} (refused by the test)")


def connect(sock, address):
    guarded(sock, address)
    return _connect(sock, address)


def connect_ex(sock, address):
    guarded(sock, address)
    return _connect_ex(sock, address)


socket.getaddrinfo = loopback_only
socket.socket.connect = connect
socket.socket.connect_ex = connect_ex


def url(host, client):
    # The discard port: nothing answers a direct connection that reaches loopback.
    return f"http://{host}:9/probe/{client}"


def python_client(name, fn):
    """Runs one Python client: "proxy" when the proxy answered (it refuses every host in
    the test's config, with 403), "direct" when the client tried to connect elsewhere."""
    def run(host):
        current[0] = (name, host)
        try:
            status = fn(url(host, name))
        except Exception as e:  # the refused direct connection surfaces as an error
            status = f"{type(e).__name__}: {e}"
        if (name, host) in went_direct:
            return "direct"
        return "proxy" if status == 403 else f"error: {status}"
    return run


def command_line(name, argv, proxied, direct_exit):
    """curl and wget run as processes, bound to 127.0.0.1: a direct connection to any
    other address fails at connect(2), before a packet leaves, and names curl would look
    up are pinned to loopback (wget looks them up; what it then connects to fails the
    same way)."""
    def run(host):
        out = subprocess.run(argv(host, url(host, name)), capture_output=True,
                             env={**os.environ, **ENV}, timeout=15)
        if proxied(out):
            return "proxy"
        if out.returncode in direct_exit:
            return "direct"
        return f"error: exit {out.returncode} {out.stdout[:40]!r} {out.stderr[:200]!r}"
    return run


def curl_argv(host, target):
    literal = host[0] == "[" or host.replace(".", "").isdigit()
    pin = [] if literal else ["--resolve", f"{host}:9:127.0.0.1"]
    return ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5",
            "--interface", "127.0.0.1"] + pin + [target]


def wget_argv(host, target):
    return ["wget", "-q", "-O", "/dev/null", "--tries=1", "--timeout=5",
            "--bind-address=127.0.0.1", target]


def urllib_get(target):
    try:
        with urllib.request.urlopen(target, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def requests_get(target):
    import requests
    return requests.get(target, timeout=5).status_code


def httpx_get(target):
    import httpx
    return httpx.get(target, timeout=5).status_code


def aiohttp_get(target):
    import aiohttp

    async def go():
        async with aiohttp.ClientSession(trust_env=True) as s:
            async with s.get(target, timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status
    return asyncio.run(go())


CLIENTS = {
    # curl prints the status it got: the proxy's 403.
    # Direct: 7, the connection failed (45 if binding did).
    "curl": command_line("curl", curl_argv, lambda out: out.stdout == b"403", {7, 45}),
    # wget exits 8 when a server answered with an error status: the proxy's 403; 4 on a
    # network failure (4 too when a name does not resolve).
    "wget": command_line("wget", wget_argv, lambda out: out.returncode == 8, {4}),
    "urllib": python_client("urllib", urllib_get),
    "requests": python_client("requests", requests_get),
    "httpx": python_client("httpx", httpx_get),
    "aiohttp": python_client("aiohttp", aiohttp_get),
}

for name, fn in CLIENTS.items():
    for host in HOSTS:
        via = fn(host)
        print(json.dumps({"client": name, "host": host, "via": via}), flush=True)

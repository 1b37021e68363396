#!/usr/bin/env bash
# HTTP/2 through interception: h2load against sluice as shipped (a CONNECT tunnel it
# intercepts, HTTP/2 by ALPN) and against haproxy ending TLS and HTTP/2 itself, both in
# front of the same nginx over TLS; with --h1, the same over HTTP/1.1. Installs h2load,
# socat and haproxy when missing. Loopback only; every process is started here and
# stopped by PID.
# Usage: bench/h2.sh [rounds=5] [seconds=5] [connections=8] [streams=16]
#        bench/h2.sh --instructions [connections=2] [streams=8]   # instructions per request under callgrind
#        bench/h2.sh --h1 [...]   # HTTP/1.1 over TLS instead (connections=32, one request at a time)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
need nghttp2-client h2load
need socat socat
need haproxy haproxy
need valgrind valgrind
install_missing
exec python3 bench/h2.py "$@"

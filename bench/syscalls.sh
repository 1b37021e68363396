#!/usr/bin/env bash
# System calls, context switches and CPU per proxied request: sluice as shipped, sluice
# with the access log off, and haproxy (as many threads as sluice has workers), counted
# with perf's tracepoints and /proc, the proxy's own and the whole machine's. Installs
# haproxy and perf from Debian's packages when missing. Loopback only.
# Usage: bench/syscalls.sh [rounds=6] [seconds=3] [wrk threads=1]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
need haproxy haproxy
need linux-perf perf
install_missing
exec python3 bench/syscalls.py "$@"

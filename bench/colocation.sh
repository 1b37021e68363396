#!/usr/bin/env bash
# How often a proxy's two busiest threads wait on one CPU: sluice as shipped, sluice with
# the log off and haproxy (2 threads) in front of the same nginx under wrk -t1 -c32.
# Installs haproxy when missing. Loopback only; every process is started here.
# Usage: bench/colocation.sh [rounds=3] [seconds=4]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
need haproxy haproxy
install_missing
exec python3 bench/colocation.py "$@"

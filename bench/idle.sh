#!/usr/bin/env bash
# Memory per idle client connection: sluice as shipped and haproxy (2 threads, its
# defaults) in front of the same nginx, each holding N keep-alive connections that made
# one request and then went quiet, as an application's connection pool leaves them.
# Installs haproxy when missing. Loopback only; every process is started here.
# Usage: bench/idle.sh [connections=2000]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
need haproxy haproxy
install_missing
exec python3 bench/idle.py "$@"

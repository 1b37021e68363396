#!/usr/bin/env bash
# User-space instructions per proxied request under callgrind: the precise way to compare
# two builds on a noisy machine. Installs valgrind from Debian's packages when missing.
# Usage: bench/callgrind.sh [seconds=8] [--top|--self] [--haproxy]
# --haproxy also counts haproxy (one thread, no log) in front of the same upstream.
# CONNS=<n> sets wrk's connections (4 by default).
# SLUICE_BIN=<path> measures another build (an older commit's, for a before/after figure).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
need valgrind valgrind
if [[ " $* " == *" --haproxy "* ]]; then need haproxy haproxy; fi
install_missing
exec python3 bench/callgrind.py "$@"

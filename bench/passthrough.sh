#!/usr/bin/env bash
# Pass-through overhead: wrk against a small nginx response, sent directly and through
# sluice (unmatched host, and a matched upstream with no limit), interleaved and repeated.
# Loopback only; every process is started here and stopped by PID.
# Usage: bench/passthrough.sh [rounds=3] [seconds=10] [connections=32]
set -euo pipefail
cd "$(dirname "$0")/.."

source bench/prepare.sh
exec python3 bench/passthrough.py "$@"

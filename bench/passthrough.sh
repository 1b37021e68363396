#!/usr/bin/env bash
# Pass-through overhead: wrk against a small nginx response, sent directly and through
# sluice (unmatched host, and a matched upstream with no limit), interleaved and repeated.
# Loopback only; every process is started here and stopped by PID.
# Usage: bench/passthrough.sh [rounds=3] [seconds=10] [connections=32]
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v wrk >/dev/null || missing+=(wrk)
command -v nginx >/dev/null || missing+=(nginx-light)
if ((${#missing[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
cargo build --release --quiet
exec python3 bench/passthrough.py "$@"

#!/usr/bin/env bash
# User-space instructions per proxied request under callgrind: the precise way to compare
# two builds on a noisy machine. Installs valgrind from Debian's packages when missing.
# Usage: bench/callgrind.sh [seconds=8] [--top|--self] [--haproxy]
# --haproxy also counts haproxy (one thread, no log) in front of the same upstream.
# SLUICE_BIN=<path> measures another build (an older commit's, for a before/after figure).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
missing=()
command -v valgrind >/dev/null || missing+=(valgrind)
if [[ " $* " == *" --haproxy "* ]] && ! command -v haproxy >/dev/null; then missing+=(haproxy); fi
if ((${#missing[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
exec python3 bench/callgrind.py "$@"

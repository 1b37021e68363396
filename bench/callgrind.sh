#!/usr/bin/env bash
# User-space instructions per proxied request under callgrind: the precise way to compare
# two builds on a noisy machine. Installs valgrind from Debian's packages when missing.
# Usage: bench/callgrind.sh [seconds=8] [--top|--self]
# SLUICE_BIN=<path> measures another build (an older commit's, for a before/after figure).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
if ! command -v valgrind >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null
fi
exec python3 bench/callgrind.py "$@"

#!/usr/bin/env bash
# Where the slow requests come from: sluice as shipped and haproxy (as many threads as
# sluice has workers) driven by wrk -t1 and by a closed-loop client that records every
# request, interleaved. Installs haproxy from Debian's packages when missing. Loopback
# only.
# Usage: bench/tail.sh [rounds=3] [seconds=6]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
if ! command -v haproxy >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null
fi
cargo build --release --quiet --example closed_loop
exec python3 bench/tail.py "$@"

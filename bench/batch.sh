#!/usr/bin/env bash
# A finite batch through a shared token bucket (10/s, burst 1): 100 curl processes at
# once, split between two release sluice replicas and then through one, one
# redis-server, an upstream logging arrivals. Loopback only; every process is started
# here and stopped by PID.
# Usage: bench/batch.sh [rounds=3] [requests=100]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
cargo build --release --quiet --bin sluice
exec python3 bench/batch.py "$@"

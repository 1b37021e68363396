#!/usr/bin/env bash
# Scale of waiting: sluice's memory with 10k requests queued on one bucket, and with
# 100k distinct partition keys seen, then after idle partitions are swept.
# Loopback only; every process is started here and stopped by PID.
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
exec python3 bench/waiting.py "$@"

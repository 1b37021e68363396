#!/usr/bin/env bash
# Scale of waiting: sluice's memory with 10k requests queued on one bucket, and with
# 100k distinct partition keys seen, then after idle partitions are swept.
# Loopback only; every process is started here and stopped by PID.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
exec python3 bench/waiting.py "$@"

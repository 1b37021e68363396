#!/usr/bin/env bash
# A flood of made-up partition keys (1 million by default): sluice's memory with the
# default max_partitions and with every key given a partition, the p99 of other
# requests meanwhile, and what /status.json and /buckets cost. Loopback only; every
# process is started here and stopped by PID.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
exec python3 bench/partitions.py "$@"

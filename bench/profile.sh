#!/usr/bin/env bash
# Where a proxied request's CPU goes: sluice as shipped, sluice with the log off and
# haproxy side by side under the same load, sampled by perf (cpu-clock: the VMs this
# runs on expose no hardware counters). Installs haproxy and perf when missing.
# Loopback only; every process is started here and stopped by PID.
# Usage: bench/profile.sh [seconds=8] [rows=12] [connections=32]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
need haproxy haproxy
need linux-perf perf
install_missing
exec python3 bench/profile.py "$@"

#!/usr/bin/env bash
# Who takes the CPU from whom: every context switch on the machine during wrk's run,
# recorded with perf's sched_switch tracepoint and sorted by the task that stopped and
# why (it slept, or a woken task preempted it). sluice as shipped, sluice with the log
# off, and haproxy with as many threads. Installs haproxy and perf from Debian's
# packages when missing. Loopback only.
# Usage: [CONNS=32] bench/switches.sh [rounds=4] [seconds=3] [wrk threads=2]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
need haproxy haproxy
need linux-perf perf
install_missing
exec python3 bench/switches.py "$@"

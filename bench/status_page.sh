#!/usr/bin/env bash
# What the status page costs the proxy: wrk with nobody watching and with the page open,
# and the feed's size with thousands of partitions. Loopback only.
# Usage: bench/status_page.sh [rounds=3] [seconds=8]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
exec python3 bench/status_page.py "$@"

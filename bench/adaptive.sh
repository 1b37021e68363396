#!/usr/bin/env bash
# Limits that follow the provider (adaptive, learn) and fairness between tenants: 429s per
# minute with and without, and an interactive tenant's wait behind a bulk one.
# Loopback only; every process is started here and stopped by PID.
# Usage: bench/adaptive.sh [seconds=60]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
exec python3 bench/adaptive.py "$@"

#!/usr/bin/env bash
# A soak under chaos (bench/soak.py): minutes of mixed traffic through the release build
# with reloads, Redis outages, an upstream outage and SIGTERM under load; RSS, descriptors
# and the limits as the upstreams saw them. Loopback only; every process is started here
# and stopped by PID.
# Usage: bench/soak.sh [SECONDS=600] [CLIENTS=60]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
need redis-server redis-server
install_missing
exec python3 bench/soak.py "$@"

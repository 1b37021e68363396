#!/usr/bin/env bash
# Memory with a queue full of large PUTs: bodies must not be read before admission.
# Loopback only; every process is started here and stopped by PID.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
exec python3 bench/replay.py "$@"

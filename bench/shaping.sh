#!/usr/bin/env bash
# Shaping accuracy: an nginx limit_req upstream (50 r/s) loaded by 40 concurrent clients,
# directly and through sluice configured slightly below the limit. Loopback only.
# Writes bench/out/shaping.csv and draws docs/shaping.png from it.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
python3 bench/shaping.py "$@"
/usr/bin/python3 bench/plot_shaping.py

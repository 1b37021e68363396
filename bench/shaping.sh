#!/usr/bin/env bash
# Shaping accuracy: an nginx limit_req upstream (50 r/s) loaded by 40 concurrent clients,
# directly and through sluice configured slightly below the limit. Loopback only.
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
exec python3 bench/shaping.py "$@"

#!/usr/bin/env bash
# The provider matrix: real rate limiters (haproxy, nginx, Python limits,
# django-ratelimit) at 10 requests per second, behind sluice set to each kind a user
# might write at the same numbers; 429s and the share of the limit used per cell.
# Loopback only. Installs what it drives when missing (as root).
# Usage: [ONLY=haproxy,nginx] bench/algorithms.sh [seconds per cell=30]
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v haproxy >/dev/null || missing+=(haproxy)
command -v nginx >/dev/null || missing+=(nginx-light)
if ((${#missing[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
python3 -c 'import limits, django, django_ratelimit' 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check 'limits==5.8.0' 'django==5.2.*' \
    'django-ratelimit==4.1.0'
cargo build --release --quiet --bin sluice
exec python3 bench/algorithms.py "$@"

#!/usr/bin/env bash
# sluice next to squid, tinyproxy (forward) and haproxy, nginx (reverse) on one machine.
# Installs the peers from Debian's packages when missing. Loopback only.
# Usage: bench/peers.sh [rounds=3] [seconds=10]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
missing=()
command -v squid >/dev/null || missing+=(squid)
command -v tinyproxy >/dev/null || missing+=(tinyproxy)
command -v haproxy >/dev/null || missing+=(haproxy)
if ((${#missing[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The Debian packages start their own services; the bench runs its own instances.
for s in squid tinyproxy haproxy; do
  if command -v systemctl >/dev/null; then systemctl stop "$s" 2>/dev/null || true; fi
  service "$s" stop >/dev/null 2>&1 || true
done
exec python3 bench/peers.py "$@"

#!/usr/bin/env bash
# sluice next to squid, tinyproxy (forward) and haproxy, nginx (reverse) on one machine.
# Installs the peers from Debian's packages when missing. Loopback only.
# Usage: bench/peers.sh [rounds=3] [seconds=10]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prepare.sh
need squid squid
need tinyproxy tinyproxy
need haproxy haproxy
install_missing
# The Debian packages start their own services; the bench runs its own instances.
for s in squid tinyproxy haproxy; do
  if command -v systemctl >/dev/null; then systemctl stop "$s" 2>/dev/null || true; fi
  service "$s" stop >/dev/null 2>&1 || true
done
exec python3 bench/peers.py "$@"

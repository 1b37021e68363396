#!/usr/bin/env bash
# Shared limits across replicas: three release sluice processes, one redis-server, one
# upstream logging arrivals. Saturation per kind, added latency, failover timing.
# Loopback only; the driver starts and stops everything by PID.
# Usage: bench/cluster.sh [seconds of saturation per kind=20]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
cargo build --release --quiet --bin sluice --example cluster
exec "${CARGO_TARGET_DIR:-target}"/release/examples/cluster "$@"

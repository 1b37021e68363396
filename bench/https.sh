#!/usr/bin/env bash
# HTTPS through sluice: plain HTTP vs intercepted HTTPS (keep-alive, and a new tunnel and
# TLS handshake per request). Loopback only; the driver starts and stops everything.
# Usage: bench/https.sh [rounds=3] [seconds=10]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin sluice --example https_load
exec "${CARGO_TARGET_DIR:-target}"/release/examples/https_load "$@"

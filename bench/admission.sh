#!/usr/bin/env bash
# Admission precision: how late after its scheduled instant a queued request reaches the
# upstream, at several rates. Loopback only; the driver starts and stops everything.
# Usage: bench/admission.sh [seconds per rate=10] [rates=50,200,1000]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin sluice --example admission
exec "${CARGO_TARGET_DIR:-target}"/release/examples/admission "$@"

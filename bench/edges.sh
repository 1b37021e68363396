#!/usr/bin/env bash
# Limits as the provider counts them: provider-side 429s and utilisation of the limit
# when sluice is set to a provider's exact limit, with slow new connections (a TLS
# handshake sluice waits out, or a first request delayed where sluice cannot see it).
# Loopback only; the driver starts and stops everything.
# Usage: bench/edges.sh [windows=12] [clients=60] [limit suffix, e.g. ', margin = "0s"']
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin sluice --example edges
exec "${CARGO_TARGET_DIR:-target}"/release/examples/edges "$@"

#!/usr/bin/env bash
# Costs: what pricing a request costs the proxy (a 4 KiB chat body priced by the built-in
# estimator, against the same request unpriced), and how much of a provider's token
# budget sluice uses against the LLM provider of tests/fixtures/llm_provider.py (OpenAI's
# estimate counted at arrival by the Python limits package; Anthropic's output tokens
# estimated then reconciled), configured as docs/config.md's examples are.
# Loopback only; every process is started here and stopped by PID.
# Usage: bench/costs.sh [rounds=3] [seconds=10] [budget_minutes=4] [all|pricing|budgets]
set -euo pipefail
cd "$(dirname "$0")/.."

source bench/prepare.sh
python3 -c 'import limits' 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore 'limits==5.8.0'
exec python3 bench/costs.py "$@"

#!/usr/bin/env bash
# Sets everything up and runs the main demo: FedAvg on scikit-learn's digits split
# non-IID across clients, with a progress bar, an accuracy table and a plot.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh examples
.venv/bin/fedlang demo "$@"

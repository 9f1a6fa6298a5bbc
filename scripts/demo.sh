#!/usr/bin/env bash
# Sets everything up and runs the main demo.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh examples
.venv/bin/python examples/temperature_sensors.py
.venv/bin/python examples/fedavg_from_scratch.py

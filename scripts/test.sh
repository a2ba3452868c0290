#!/usr/bin/env bash
# Set up .venv and run the whole test suite (CPU, offline).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh dev
export WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error COMLRL_DISABLE_PROGRESS=1
# Every core (pytest-xdist; tests that must not share the machine are in one xdist_group), and the 15
# slowest tests at the end. Arguments given here come after these: `-n 0` runs in one process.
exec .venv/bin/python -m pytest -n auto --dist loadgroup --durations=15 "$@"

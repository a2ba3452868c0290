#!/usr/bin/env bash
# Set up .venv and run the whole test suite (CPU, offline).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh dev
export WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error COMLRL_DISABLE_PROGRESS=1
exec .venv/bin/python -m pytest "$@"

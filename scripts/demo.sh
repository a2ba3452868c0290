#!/usr/bin/env bash
# The main job: the seed's train-then-resume example on a built-in tiny model, offline.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh plot
export WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
exec .venv/bin/python examples/resume_demo.py "$@"

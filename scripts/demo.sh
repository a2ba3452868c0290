#!/usr/bin/env bash
# The main job, on a built-in tiny model, offline: our user document's train-then-resume example as
# written, then the same example at a learning rate that learns, resumed twice; prints a table of both
# reward curves and plots them (runs/resume-demo/reward_curve.png). About a minute on 2 CPU cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh plot
export WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
# One intra-op thread: the tiny model runs faster on one, and is immune to a busy second core.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python examples/resume_demo.py "$@"

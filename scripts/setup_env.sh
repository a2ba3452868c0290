#!/usr/bin/env bash
# Create (or reuse) .venv and install comlrl with the given extras. Run by demo.sh and test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    # Debian splits ensurepip into python3-venv; fall back to virtualenv from PyPI without it.
    "$PYTHON" -m venv .venv 2>/dev/null || {
        rm -rf .venv
        "$PYTHON" -m pip install --quiet --user virtualenv && "$PYTHON" -m virtualenv --quiet .venv
    }
fi
# torch first, pinned: 2.13.0 is the CPU build on our machines; an unpinned torch would pull CUDA.
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$1]"

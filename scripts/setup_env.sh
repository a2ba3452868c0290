#!/usr/bin/env bash
# Create (or reuse) .venv and install comlrl with the given extras. Run by demo.sh and test.sh.
# pip runs only when something it would act on changed since the last install of these extras
# (pyproject.toml, this script, the Python); COMLRL_SETUP_FORCE=1 runs it anyway.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
EXTRAS="${1:?usage: setup_env.sh EXTRAS (e.g. dev, plot)}"
TORCH_PIN="torch==2.13.0"
if [ ! -x .venv/bin/python ]; then
    # Debian splits ensurepip into python3-venv; fall back to virtualenv from PyPI without it.
    "$PYTHON" -m venv .venv 2>/dev/null || {
        rm -rf .venv
        "$PYTHON" -m pip install --quiet --user virtualenv && "$PYTHON" -m virtualenv --quiet .venv
    }
fi
stamp=".venv/.comlrl-setup-${EXTRAS//[^A-Za-z0-9_,-]/_}"
# What the install depends on; the checkout's path too (a venv copied from another checkout has its
# editable install pointing there).
wanted="$( { cat pyproject.toml scripts/setup_env.sh; echo "$TORCH_PIN $PWD"; .venv/bin/python -VV; } | sha256sum | cut -d' ' -f1)"
# The installed state must still be there (a pip uninstall since the stamp was written): read from
# the package metadata, without importing torch.
installed() {
    # -I: not the checkout's own comlrl.egg-info (the working directory), the venv's install
    .venv/bin/python -I - "$TORCH_PIN" <<'PY' 2>/dev/null
import sys
from importlib import metadata
torch_version = sys.argv[1].split("==")[1]
assert metadata.version("torch").split("+")[0] == torch_version  # 2.13.0+cpu
dist = metadata.distribution("comlrl")
assert dist.read_text("direct_url.json") and "editable" in dist.read_text("direct_url.json")
PY
}
if [ -z "${COMLRL_SETUP_FORCE:-}" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] && installed; then
    exit 0
fi
rm -f "$stamp"
# A comlrl.egg-info of an earlier version in the checkout (setuptools does not always rewrite it) would
# shadow the venv's metadata for anything run from here (importlib.metadata reads the working directory).
rm -rf comlrl.egg-info
# torch first, pinned: 2.13.0 is the CPU build on our machines; an unpinned torch would pull CUDA.
.venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_PIN"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$EXTRAS]"
echo "$wanted" > "$stamp"

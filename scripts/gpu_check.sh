#!/usr/bin/env bash
# The GPU check: on a CUDA machine, set up what it needs and print ONE report of
#   the CUDA tests (bf16, agent_devices, torchrun/NCCL, the lean decoder == transformers on CUDA),
#   the vLLM rollout backend with the real vLLM on a tiny model,
#   the throughput benchmark on a random 0.5B Qwen2 in bf16 beside comlrl 1.4.3 and TRL.
#
#   bash scripts/gpu_check.sh                      # on a GPU machine (installs into $WORKDIR, see below)
#   bash scripts/gpu_check.sh --dry-run            # anywhere: CPU, CUDA steps skipped, tiny model, installs nothing
#
# docs/gpu-check.md says what the report contains. Options (everything else is passed to
# scripts/gpu_check.py, e.g. --skip bench, --bench-epochs 3):
#   --dry-run          exercise the whole check on the CPU with the project's .venv (scripts/test.sh makes it)
#   --report FILE      the report's path (default: $WORKDIR/report.txt; FILE.json is written beside it)
#   --workdir DIR      venvs, logs and the report (default: $COMLRL_GPU_CHECK_DIR or /tmp/comlrl-gpu-check)
#   --python PY        the interpreter to build the venvs from (default: python3); with --dry-run,
#                      the interpreter that runs everything (default: .venv/bin/python)
#   --wheelhouse DIR   install offline from the wheels in DIR (pip --no-index --find-links DIR)
#   --no-install       use the venvs already in $WORKDIR as they are
#   --comlrl-python PY / --trl-python PY / --vllm-python PY   use these interpreters instead of installing
#
# What it installs (not with --dry-run): venvs under $WORKDIR, each seeing the base Python's packages
# when the base Python already has a CUDA torch (that torch is then used, not downloaded again):
#   main    comlrl (this tree, editable) with the peft and bench extras, and pytest
#   vllm    comlrl with the vllm extra (vLLM pins its own CUDA torch), and pytest
#   comlrl  comlrl==1.4.3 (the peer of benchmarks/README.md)
#   trl     trl==1.16.0   (the peer of benchmarks/README.md)
# Without a CUDA torch in the base Python, each venv gets `pip install torch` first: the default
# index serves CUDA wheels on Linux. A failed install is reported and its steps are skipped; the
# rest of the check runs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DRY_RUN=0 NO_INSTALL=0 REPORT="" WHEELHOUSE="" BASE_PYTHON="${PYTHON:-}"
WORKDIR="${COMLRL_GPU_CHECK_DIR:-/tmp/comlrl-gpu-check}"
COMLRL_PY="" TRL_PY="" VLLM_PY=""
PASS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --no-install) NO_INSTALL=1 ;;
        --report) REPORT="$2"; shift ;;
        --workdir) WORKDIR="$2"; shift ;;
        --python) BASE_PYTHON="$2"; shift ;;
        --wheelhouse) WHEELHOUSE="$(cd "$2" && pwd)"; shift ;;
        --comlrl-python) COMLRL_PY="$2"; shift ;;
        --trl-python) TRL_PY="$2"; shift ;;
        --vllm-python) VLLM_PY="$2"; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) PASS+=("$1") ;;
    esac
    shift
done
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error COMLRL_DISABLE_PROGRESS=1 \
    TOKENIZERS_PARALLELISM=false
mkdir -p "$WORKDIR/logs"
REPORT="${REPORT:-$WORKDIR/report.txt}"
SETUP="$WORKDIR/setup.jsonl"
: > "$SETUP"

record() {  # record NAME STATUS DETAIL: one install step for the report's [setup] section
    python3 - "$SETUP" "$1" "$2" "$3" <<'EOF' 2>/dev/null || echo "{\"name\": \"$1\", \"status\": \"$2\", \"detail\": \"\"}" >> "$SETUP"
import json, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"name": sys.argv[2], "status": sys.argv[3], "detail": sys.argv[4]}) + "\n")
EOF
}

peer_args() {
    local args=()
    [ -n "$COMLRL_PY" ] && args+=(--comlrl-python "$COMLRL_PY")
    [ -n "$TRL_PY" ] && args+=(--trl-python "$TRL_PY")
    [ -n "$VLLM_PY" ] && args+=(--vllm-python "$VLLM_PY")
    [ ${#args[@]} -gt 0 ] && printf '%s\n' "${args[@]}"
    return 0
}

if [ "$DRY_RUN" = 1 ]; then
    MAIN_PY="${BASE_PYTHON:-.venv/bin/python}"
    if ! "$MAIN_PY" -c "import comlrl, pytest" 2>/dev/null; then
        echo "gpu_check --dry-run: $MAIN_PY cannot import comlrl and pytest; run 'bash scripts/test.sh -m \"not slow\"' (it makes .venv) or pass --python" >&2
        exit 2
    fi
    record main "dry run" "nothing installed; would create $WORKDIR/venv-main with comlrl (this tree) with the peft and bench extras, and pytest; using $MAIN_PY"
    for name in vllm comlrl trl; do
        case $name in
            vllm) what="comlrl with the vllm extra (vLLM and its CUDA torch), and pytest" ;;
            comlrl) what="comlrl==1.4.3" ;;
            trl) what="trl==1.16.0" ;;
        esac
        record "$name" "dry run" "nothing installed; would create $WORKDIR/venv-$name with $what"
    done
    mapfile -t EXTRA < <(peer_args)
    exec "$MAIN_PY" scripts/gpu_check.py --dry-run --report "$REPORT" --workdir "$WORKDIR/logs" --setup "$SETUP" \
        "${EXTRA[@]}" "${PASS[@]}"
fi

# ---- a CUDA machine ---------------------------------------------------------------------------
BASE_PYTHON="${BASE_PYTHON:-python3}"
if "$BASE_PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    SYSTEM_TORCH=1   # reuse it: no multi-GB download, and it already matches this machine's driver
else
    SYSTEM_TORCH=0
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "gpu_check: no CUDA here ($BASE_PYTHON has no CUDA torch and there is no nvidia-smi); run with --dry-run on a CPU machine" >&2
        exit 2
    fi
fi
PIP_OPTS=(--quiet --disable-pip-version-check)
[ -n "$WHEELHOUSE" ] && PIP_OPTS+=(--no-index --find-links "$WHEELHOUSE")

make_venv() {  # make_venv NAME -> prints the venv's python; 1 when it cannot be made
    local dir="$WORKDIR/venv-$1"
    if [ ! -x "$dir/bin/python" ]; then
        "$BASE_PYTHON" -m venv "$dir" >>"$WORKDIR/logs/install-$1.log" 2>&1 || return 1
        if [ "$SYSTEM_TORCH" = 1 ]; then
            # The base Python's packages (its CUDA torch above all) after the venv's own, by a .pth
            # file: --system-site-packages would skip them when the base Python is itself a venv.
            local site
            site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
            "$BASE_PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/_comlrl_base_site.pth" \
                || return 1
        fi
    fi
    echo "$dir/bin/python"
}

install() {  # install NAME PIP-ARGS...: make the venv, pip install; records the step; prints the python
    local name="$1"; shift
    local py
    if [ "$NO_INSTALL" = 1 ] && [ ! -x "$WORKDIR/venv-$name/bin/python" ]; then
        record "$name" "missing" "--no-install, and there is no $WORKDIR/venv-$name"
        return 1
    fi
    if ! py="$(make_venv "$name")"; then
        record "$name" "FAILED" "could not create $WORKDIR/venv-$name (log: $WORKDIR/logs/install-$name.log)"
        return 1
    fi
    if [ "$NO_INSTALL" = 1 ]; then
        record "$name" "reused" "$py (--no-install)"
        echo "$py"; return 0
    fi
    if [ "$SYSTEM_TORCH" = 0 ] && ! "$py" -c "import torch" 2>/dev/null; then
        "$py" -m pip install "${PIP_OPTS[@]}" torch >>"$WORKDIR/logs/install-$name.log" 2>&1
    fi
    if "$py" -m pip install "${PIP_OPTS[@]}" "$@" >>"$WORKDIR/logs/install-$name.log" 2>&1; then
        record "$name" "installed" "$py: $*"
        echo "$py"
    else
        local log="$WORKDIR/logs/install-$name.log" why
        why="$(grep -E '^(ERROR|error)' "$log" | tail -n 1)"
        record "$name" "FAILED" "pip install $*: ${why:-$(tail -n 1 "$log")} (log: $log)"
        return 1
    fi
}

echo "gpu_check: setting up in $WORKDIR (logs in $WORKDIR/logs) ..." >&2
MAIN_PY="$(install main -e ".[peft,bench]" pytest)" || {
    # No package index (and no wheelhouse): comlrl alone, on the packages the base Python has;
    # whatever is missing shows up in the report (e.g. model d falls back to the tiny vocabulary).
    py="$WORKDIR/venv-main/bin/python"
    site="$([ -x "$py" ] && "$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)"
    if [ "$NO_INSTALL" = 0 ] && [ -n "$site" ] && echo "$PWD" > "$site/_comlrl_tree.pth" \
            && "$py" -c "import comlrl, pytest" 2>/dev/null; then
        MAIN_PY="$py"
        record main-fallback "this tree on the path" "$py imports comlrl from $PWD, on the base Python's packages"
    else
        MAIN_PY="$BASE_PYTHON"
        record main-fallback "using $BASE_PYTHON" "with this tree on PYTHONPATH (what it lacks shows up as failures)"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
}
[ -z "$VLLM_PY" ] && { VLLM_PY="$(install vllm -e ".[vllm]" pytest)" || VLLM_PY=""; }
[ -z "$COMLRL_PY" ] && { COMLRL_PY="$(install comlrl "comlrl==1.4.3")" || COMLRL_PY=""; }
[ -z "$TRL_PY" ] && { TRL_PY="$(install trl "trl==1.16.0")" || TRL_PY=""; }
mapfile -t EXTRA < <(peer_args)
exec "$MAIN_PY" scripts/gpu_check.py --report "$REPORT" --workdir "$WORKDIR/logs" --setup "$SETUP" \
    "${EXTRA[@]}" "${PASS[@]}"

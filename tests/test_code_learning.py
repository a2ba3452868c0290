"""MAGRPO through the sandboxed code reward makes the small code model write better code on
problems it never trained on: examples/code_collab.py on its defaults (two agents, aux and the
entry point; the RL problems of comlrl.testing.code_rl_problems; 4 epochs), three seeds, held-out
pass@1 before the first update against after the last one (issue 28).

The threshold comes from the rises measured under the default / AVX2 / AVX-512 kernels
(ATEN_CPU_CAPABILITY, ../shared/tools/cpu-variants.sh), quoted in the test."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SEEDS = (0, 1, 2)


def pass_at_1_rise(out: Path) -> tuple[float, float]:
    """(held-out pass@1 before any update, after the last update) of one example run."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if "eval/turn_1/pass@1" in r)
    assert first["global_step"] == 0
    last = json.loads((out / "final_eval.json").read_text())
    return first["eval/turn_1/pass@1"], last["eval/turn_1/pass@1"]


def test_magrpo_raises_held_out_pass_at_1_in_every_seed(tmp_path):
    """Measured 2026-12-06 (AMD EPYC, AVX-512), before -> after (rise) per seed 0 / 1 / 2:
    - default and AVX2 kernels (the same figures): 0.120 -> 0.432 (0.312) / 0.125 -> 0.411 (0.286) /
      0.135 -> 0.406 (0.271), mean rise 0.290;
    - AVX-512: 0.120 -> 0.432 (0.312) / 0.125 -> 0.380 (0.255) / 0.135 -> 0.406 (0.271), mean 0.279.

    Asserted: a mean rise of 0.20 over the seeds (0.08 below the lowest mean measured) and 0.10 in
    each seed; the warm model is the package's copy on every machine."""
    results = []
    for seed in SEEDS:
        out = tmp_path / f"seed{seed}"
        proc = subprocess.run([sys.executable, "examples/code_collab.py", "--seed", str(seed),
                               "--output-dir", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(pass_at_1_rise(out))
    rises = [after - before for before, after in results]
    print("\nheld-out pass@1 (before, after) per seed:", [tuple(round(x, 3) for x in r) for r in results],
          "rises:", [round(r, 3) for r in rises])
    assert all(0.05 <= before <= 0.5 for before, _ in results)
    assert statistics.mean(rises) >= 0.20 and min(rises) >= 0.10

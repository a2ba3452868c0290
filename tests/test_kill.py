"""kill -9 at random moments (some during a checkpoint save), then resume == uninterrupted."""

import json
import os
import random
import time
from pathlib import Path

import pytest
import torch
from helpers import forked, run_forked, stop
from safetensors.torch import load_file


pytestmark = pytest.mark.slow  # the fast suite: pytest -m "not slow"

TRIALS = int(os.environ.get("COMLRL_KILL_TRIALS", "4"))


def run_worker(run_dir, kill_after=None, slow_save=0.0, family="magrpo", in_save=None):
    """Run the worker; with kill_after, SIGKILL it that many seconds after training starts. With
    in_save (seconds), wait after that for the next checkpoint save to begin (its staging folder to
    appear) and kill in_save seconds into it."""
    import kill_worker

    if kill_after is None:
        run_forked(kill_worker.main, run_dir, slow_save, family)
        return False
    proc = forked(kill_worker.main, run_dir, slow_save, family)
    metrics = run_dir / "ckpt" / "metrics.jsonl"

    def staging():
        return (run_dir / "ckpt").glob(".tmp-checkpoint-*")

    before = set(staging())
    deadline = time.time() + 300
    try:
        while not metrics.exists() and proc.is_alive() and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(kill_after)
        if in_save is not None:  # a staging folder of this run's (one of a killed run's may still be there)
            while proc.is_alive() and time.time() < deadline and set(staging()) <= before:
                time.sleep(0.002)
            time.sleep(in_save)
    finally:
        stop(proc)  # SIGKILL, wherever the waiting ended
    return bool(set(staging()) - before)  # killed inside a save


def kill_once(run_dir, rng, slow, inside_save, span, family="magrpo"):
    """One run of the worker, SIGKILLed at a random moment up to ``span`` seconds into training or,
    with ``inside_save``, 0-0.2 s into the first save begun after a random moment of up to 1 s.
    ``slow`` stretches every file write of a save by that many seconds on each side. Returns
    whether the kill landed inside a save."""
    if inside_save:
        return run_worker(run_dir, kill_after=rng.uniform(0.0, 1.0), slow_save=slow, family=family,
                          in_save=rng.uniform(0.0, 0.2))
    return run_worker(run_dir, kill_after=rng.uniform(0.0, span), slow_save=slow, family=family)


def rows(run_dir):
    out = []
    for line in (run_dir / "ckpt" / "metrics.jsonl").read_text().splitlines():
        out.append({k: v for k, v in json.loads(line).items() if not k.startswith("timing/") and k != "run_id"})
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    start = time.time()
    run_worker(run_dir)
    return run_dir, load_file(str(run_dir / "final.safetensors")), rows(run_dir), time.time() - start


def test_sigkill_then_resume_equals_uninterrupted(reference, tmp_path):
    ref_dir, ref_tensors, ref_rows, duration = reference
    rng = random.Random(1234)
    mid_saves = 0
    for trial in range(TRIALS):
        run_dir = tmp_path / f"trial-{trial}"
        # Kill once or twice at random moments of the training phase, then let it finish. Odd trials
        # stretch the saves (0.05 s around each file write) and kill the second time at a random
        # moment inside a save.
        slow = 0.05 if trial % 2 else 0.0
        for kill in range(1 + trial % 2):
            mid_saves += kill_once(run_dir, rng, slow, inside_save=kill == 1, span=6.0 if slow else 2.5)
        run_worker(run_dir)
        tensors = load_file(str(run_dir / "final.safetensors"))
        assert tensors.keys() == ref_tensors.keys()
        for key in tensors:
            assert torch.equal(tensors[key], ref_tensors[key]), (trial, key)
        assert rows(run_dir) == ref_rows, trial
        names = sorted(p.name for p in (run_dir / "ckpt").iterdir() if "checkpoint" in p.name)
        assert names == ["checkpoint-10", "checkpoint-11", "checkpoint-12"], names
    print(f"\n{TRIALS} kill trials, {mid_saves} kill(s) landed during a checkpoint save")
    if TRIALS >= 4:
        assert mid_saves >= 1, "no kill hit a save; the test did not exercise crash safety"


@pytest.mark.parametrize("family, marker", [("maac", "critic-0."), ("madpo_iter", "agent-1.")])
def test_sigkill_of_an_actor_critic_or_preference_run_then_resume_equals_uninterrupted(tmp_path, family, marker):
    """MAAC (agents, a critic, their optimizers, a reference KL) and iterative MADPO (pair sets,
    replay shards, iterations): killed at a random moment, or (odd trials, saves stretched) inside a
    save, then resumed, each ends exactly where an uninterrupted run ends."""
    reference = tmp_path / "reference"
    run_worker(reference, family=family)
    expected, expected_rows = load_file(str(reference / "final.safetensors")), rows(reference)
    assert any(k.startswith(marker) for k in expected)
    rng = random.Random(99)
    for trial in range(max(2, TRIALS // 2)):
        run_dir = tmp_path / f"trial-{trial}"
        slow = 0.05 if trial % 2 else 0.0
        landed = kill_once(run_dir, rng, slow, inside_save=bool(slow), span=2.0, family=family)
        assert landed or not slow, f"trial {trial}: the kill did not land inside a save"
        run_worker(run_dir, family=family)
        tensors = load_file(str(run_dir / "final.safetensors"))
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[k], expected[k]) for k in tensors), trial
        assert rows(run_dir) == expected_rows, trial

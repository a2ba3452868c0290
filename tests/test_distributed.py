"""Data parallel under torchrun (2 gloo processes on CPU) against one process.

* 2 processes == 1 process with the same global batch (within float tolerance; same samples and
  rewards), also for multi-turn with early termination, micro-batches, token_mean, an uneven last
  optimizer step that leaves a rank idle, and evaluation; and for LoRA agents with dr_grpo;
* a 2-process run resumed from its checkpoint == the uninterrupted 2-process run, bit for bit;
* a 2-process checkpoint resumes on 1 process (allowed, said, within tolerance);
* more processes than prompts per optimizer step is refused at start.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


# The fast suite: pytest -m "not slow". One xdist worker runs the module, so its runs are made once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed")]
WORKER = Path(__file__).with_name("dist_worker.py")
TIMING = "timing/"


def run(run_dir: Path, *args: str, procs: int = 1, expect_ok: bool = True, worker_dir: bool = True,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """One launch of dist_worker.py: ``run_dir`` and ``args`` are its command line (``worker_dir=False``:
    ``args`` alone, e.g. ``--batch SPECS``)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] \
        if procs > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COMLRL_DISABLE_PROGRESS": "1"}
    env.pop("WORLD_SIZE", None)
    result = subprocess.run(launcher + [str(WORKER), *([str(run_dir)] if worker_dir else []), *args],
                            capture_output=True, text=True, timeout=timeout, env=env)
    if expect_ok:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


class Refused(tuple):
    """A batch entry (run folder, options...) whose run must be refused before it trains."""

    def __new__(cls, *spec):
        return super().__new__(cls, spec)


def resumed(source: Path, run_dir: Path, *args: str) -> list:
    """Batch entries: copy ``source`` to ``run_dir``, then resume it there from its checkpoint-2."""
    return [("copy", source, run_dir), (run_dir, *args, "--resume", str(run_dir / "ckpt" / "checkpoint-2"))]


def batch(root: Path, entries: list, procs: int) -> None:
    """Run ``entries`` one after another in one launch of dist_worker.py (one import of torch and
    transformers, one process group): ``(run_dir, options...)`` trains, ``Refused(run_dir, ...)``
    must raise, ``("copy", src, dst)`` copies a run folder. A run that fails ends the launch; the
    tests that read it fail in ``finished`` with its traceback, the others pass."""
    specs = []
    for entry in entries:
        if entry[0] == "copy":
            specs.append({"copy": [str(entry[1]), str(entry[2])]})
        else:
            specs.append({"args": [str(a) for a in entry], "expect_error": isinstance(entry, Refused)})
    spec_file = root / f"batch-{len(list(root.glob('batch-*.json')))}.json"
    spec_file.write_text(json.dumps(specs))
    result = run(root, "--batch", str(spec_file), procs=procs, expect_ok=False, worker_dir=False,
                 timeout=1200)
    spec_file.with_suffix(".log").write_text(f"exit status {result.returncode}\n{result.stdout[-2000:]}"
                                             f"\n{result.stderr[-6000:]}")


def _launch_log(run_dir: Path) -> str:
    logs = sorted(p for parent in run_dir.parents for p in parent.glob("batch-*.log"))
    return "\n".join(p.read_text() for p in logs[:4])


def finished(run_dir: Path, procs: int = 1) -> Path:
    """``run_dir``, once every process finished its run in a ``batch``; else its error, or the launch's."""
    errors = sorted(run_dir.glob("error-rank*.txt"))
    assert not errors, errors[0].read_text()
    assert all((run_dir / f"done-rank{r}").exists() for r in range(procs)), \
        f"{run_dir.name} did not finish:\n{_launch_log(run_dir)}"
    return run_dir


def refused(run_dir: Path, procs: int) -> str:
    """The message every process of a ``Refused`` run raised (the same on each)."""
    messages = {(run_dir / f"error-rank{r}.txt").read_text() for r in range(procs)
                if (run_dir / f"error-rank{r}.txt").exists()}
    assert len(messages) == 1 and all((run_dir / f"done-rank{r}").exists() for r in range(procs)), \
        f"{run_dir.name} was not refused on every process:\n{_launch_log(run_dir)}"
    return messages.pop()


def final(run_dir: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / f"final-rank{rank}.safetensors"))


def rows(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "ckpt" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.append({k: v for k, v in row.items() if not k.startswith(TIMING) and k != "run_id"})
    return out


def _sampled(key: str) -> bool:
    """Keys that come from the samples and the task's reward (the same samples: equal exactly)."""
    return "reward" in key or "return" in key or "length" in key or key in ("env_step", "global_step")


def assert_close_runs(a: Path, b: Path, exact=_sampled, atol: float = 1e-5) -> None:
    """The same run on different process counts: the first optimizer step's summed gradients agree
    within helpers.GRADIENT_RTOL (summation order is all that differs), the final weights within how
    far AdamW can carry rounding in that many steps (helpers.adamw_divergence_bound: a near-zero
    gradient may point either way), the logged rows as below."""
    from helpers import adamw_divergence_bound, assert_same_gradients

    ga, gb = (load_file(str(run / "grads-rank0.safetensors")) for run in (a, b))
    step = min({k.split("/")[0] for k in ga} & {k.split("/")[0] for k in gb}, key=int)  # the first step both took
    assert_same_gradients(*({k: v for k, v in g.items() if k.startswith(f"{step}/")} for g in (ga, gb)))
    wa, wb = ({k: v for k, v in final(run).items() if ".opt." not in k} for run in (a, b))  # moments: keyed by
    assert wa.keys() == wb.keys()  # parameter index, or by name when gathered from shards
    steps = rows(a)[-1]["global_step"]
    bound = adamw_divergence_bound(steps, lr=1e-3)  # every module of dist_worker.py trains at 1e-3
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=bound, msg=key)
    ra, rb = rows(a), rows(b)
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys()
        for key in x:
            if exact(key):
                assert x[key] == y[key], key  # the same samples, so the same rewards
            else:
                assert x[key] == pytest.approx(y[key], rel=1e-3, abs=atol), key


MULTI_TURN = ("--num-turns", "2", "--train-batch-size", "4", "--micro-batches", "2", "--loss-type", "token_mean",
              "--extra-prompt", "--eval")
LORA = ("--lora", "--loss-type", "dr_grpo")
ACTOR_CRITIC = {"iac": (), "iac-shared": ("--num-turns", "2", "--micro-batches", "2"), "maac": ("--extra-prompt", "--eval")}
PREFERENCE = ("madpo", "marlhf")
# Each run here twice: on one process and on two, the same global batch.
PAIRED = {"plain": (), "multi-turn": MULTI_TURN, "lora": LORA,
          **{f"ac-{family}": ("--family", family, *extra) for family, extra in ACTOR_CRITIC.items()},
          **{f"pref-{family}": ("--family", family) for family in PREFERENCE}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run this module's tests compare, in two launches (one of 2 processes, one of 1; one
    import each): the PAIRED runs on each count, the plain run for 4 epochs, resumed from its
    2-epoch checkpoint on 2 processes and on 1, and a refused 2-process run."""
    root = tmp_path_factory.mktemp("dist")
    two = root / "plain" / "two"
    batch(root, [*((root / name / "two", *args) for name, args in PAIRED.items()),
                 (root / "plain" / "two-4", "--epochs", "4"),
                 *resumed(two, root / "plain" / "two-resumed", "--epochs", "4"),
                 Refused(root / "refused", "--train-batch-size", "1")], procs=2)
    batch(root, [*((root / name / "one", *args) for name, args in PAIRED.items()),
                 *resumed(two, root / "plain" / "two-on-one", "--epochs", "4")], procs=1)
    return root


def test_two_processes_match_one(runs):
    one, two = finished(runs / "plain" / "one"), finished(runs / "plain" / "two", procs=2)
    assert_close_runs(one, two)
    # Every rank holds identical weights and moments; the counters saw the whole global batch.
    w0, w1 = final(two, 0), final(two, 1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    for rank in (0, 1):
        seen = json.loads((two / f"rank{rank}.json").read_text())
        assert (seen["world_size"], seen["env_step"]) == (2, 32), seen
    # Written once: one metrics row per step, checkpoints and save_model output from rank 0.
    assert [r["global_step"] for r in rows(two)] == [1, 2]
    assert sorted(p.name for p in (two / "ckpt").iterdir()) == \
        [".comlrl.lock", "checkpoint-1", "checkpoint-2", "metrics.jsonl"]
    assert sorted(p.name for p in (two / "saved").iterdir()) == [".comlrl-export.json", "agent_0", "agent_1"]
    state = json.loads((two / "ckpt" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and len(state["rng_other_ranks"]) == 1
    assert any(k.startswith("rank1/") for k in load_file(str(two / "ckpt" / "checkpoint-2" / "rng.safetensors")))


def test_two_process_resume_is_exact(runs):
    a, b = (finished(runs / "plain" / name, procs=2) for name in ("two-4", "two-resumed"))
    wa, wb = final(a), final(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert rows(a) == rows(b)


def test_resume_on_another_process_count(runs):
    other = finished(runs / "plain" / "two-on-one")
    assert "written by 2 process(es) and resumes on 1" in (other / "log-rank0.txt").read_text()
    assert_close_runs(finished(runs / "plain" / "two-4", procs=2), other)


def test_multi_turn_accumulation_uneven_batches_match(runs):
    one, two = finished(runs / "multi-turn" / "one"), finished(runs / "multi-turn" / "two", procs=2)
    assert_close_runs(one, two)
    assert any("eval/reward_mean" in r for r in rows(two))


def test_lora_agents_two_processes_match_one(runs):
    one, two = finished(runs / "lora" / "one"), finished(runs / "lora" / "two", procs=2)
    assert_close_runs(one, two)
    w0, w1 = final(two, 0), final(two, 1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0) and all("lora_" in k for k in w0 if ".opt." not in k)
    bases = {json.loads((two / f"rank{r}.json").read_text())["base"] for r in (0, 1)}
    assert len(bases) == 1


def test_more_processes_than_prompts_per_batch_is_refused(runs):
    message = refused(runs / "refused", procs=2)
    assert "train_batch_size=1" in message and "at least 2" in message
    assert not (runs / "refused" / "ckpt").exists()


def test_data_parallel_example_with_lora_and_kl(tmp_path):
    """examples/data_parallel.py as docs/scaling.md runs it: 2 processes, LoRA agents, KL, resume."""
    example = Path(__file__).parents[1] / "examples" / "data_parallel.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COMLRL_DISABLE_PROGRESS": "1"}
    env.pop("WORLD_SIZE", None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(example),
                "--workdir", str(tmp_path), "--lora", "--kl", "0.05"]
    for extra in (["--epochs", "2"], ["--epochs", "3", "--resume"]):
        result = subprocess.run(launcher + extra, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stderr[-4000:]
    assert "2 process(es): reward" in result.stdout and "after 3 steps" in result.stdout
    logged = [json.loads(line) for line in (tmp_path / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in logged] == [1, 2, 3] and all("agent_1/reference_kl" in r for r in logged)
    assert (tmp_path / "final" / "agent_1" / "adapter_config.json").is_file()


@pytest.mark.parametrize("family", list(ACTOR_CRITIC))
def test_actor_critic_two_processes_match_one(runs, family):
    """Actor-critic runs (critics, value heads, reference KL, advantages standardised over both
    processes' samples) are the same on 2 processes as on 1 (iac-shared with 2 turns and 2
    micro-batches, maac with an uneven last step and evaluation)."""
    one, two = finished(runs / f"ac-{family}" / "one"), finished(runs / f"ac-{family}" / "two", procs=2)
    assert_close_runs(one, two)
    w0, w1 = final(two, 0), final(two, 1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert any(k.startswith("critic-0.") for k in w0) == (family != "iac-shared")


@pytest.mark.parametrize("family", PREFERENCE)
def test_preference_two_processes_match_one(runs, family):
    """Pairs sampled on two processes and gathered, DPO / reward-model / online steps split over them:
    the same run as on one process."""
    one, two = finished(runs / f"pref-{family}" / "one"), finished(runs / f"pref-{family}" / "two", procs=2)
    # Model-derived numbers (DPO margins, reward-model scores) agree within tolerance, task rewards exactly.
    assert_close_runs(one, two, exact=lambda key: key in (
        "env_step", "global_step", "preference/pairs") or "length" in key or key.startswith(
        ("train/reward_", "train/task_reward")), atol=1e-5 if family == "madpo" else 1e-3)
    # (MARLHF: the reward model's inputs are padded per process, so its scores, hence the online
    # phase's advantages, differ in the last float digits: measured <= 2.3e-4 after two epochs.)
    w0, w1 = final(two, 0), final(two, 1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)

"""Plain helpers shared by the tests (importable: the tests folder is on sys.path)."""

from pathlib import Path

from comlrl.testing import SEED_PROMPTS, length_ratio_reward

__all__ = ["SEED_PROMPTS", "TEST_SETTINGS", "length_ratio_reward", "state_of", "assert_bit_exact", "rows", "play",
           "record_gradients", "assert_same_gradients", "GRADIENT_RTOL", "adamw_divergence_bound", "write_config",
           "forked", "finish", "run_forked", "stop", "run_cli", "worker_errors"]

# What most tests train with, set explicitly rather than relying on the (CoMLRL 1.4.3) defaults:
# one turn, one prompt per optimizer step, plain sampling, the GRPO token-mean loss.
TEST_SETTINGS = dict(num_turns=1, num_generations=4, logging_steps=1, eval_interval=0, rollout_buffer_size=1,
                     temperature=1.0, top_p=1.0, top_k=50, loss_type="grpo", advantage_normalization=False,
                     weight_decay=0.0, max_grad_norm=1.0, shuffle=True, early_termination_threshold=None)


def never_stepped(optimizer) -> bool:
    """True when an AdamW has not applied a step: its state (allocated when the trainer was
    built) still holds step 0 and zero moments."""
    return all(float(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
               for st in optimizer.state.values())


def state_of(trainer):
    """Every parameter and optimizer tensor of every trained module, by name."""
    import torch

    out = {}
    slots = trainer.trained_slots()
    for slot, module in slots.modules.items():
        for n, p in module.named_parameters():
            out[f"{slot}.param.{n}"] = p.detach().clone()
    for slot, opt in slots.optimizers.items():
        for idx, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                out[f"{slot}.opt.{idx}.{k}"] = v.clone() if torch.is_tensor(v) else v
    return out


def assert_bit_exact(a, b):
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k


def _whole(grad):
    """A gradient as one tensor (a sharded one gathered: a collective every process runs)."""
    return (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()


def record_gradients(trainer):
    """Start recording, for every optimizer step of ``trainer``, the gradients each optimizer is
    about to apply (after clipping); returns the list that fills, one ``{slot.index: grad}`` per step."""
    steps = []

    def hook(slot):
        def record(optimizer, args, kwargs):
            grads = {f"{slot}.{i}": _whole(p.grad) for i, p in
                     enumerate(p for group in optimizer.param_groups for p in group["params"]) if p.grad is not None}
            if not steps or slot in {k.split(".")[0] for k in steps[-1]}:
                steps.append({})
            steps[-1].update(grads)
        return record

    for slot, opt in trainer.trained_slots().optimizers.items():
        opt.register_step_pre_hook(hook(slot))
    return steps


# Float32 gradients of the same loss computed in other batch shapes (micro-batches, processes, one
# row at a time) differ by reordered sums: a relative error of about (depth) x sqrt(contraction
# length) x 2**-24 ~ 20 x 32 x 6e-8 ~ 4e-5 for our tiny models, on any processor's kernels. 1e-4 of
# the step's gradient norm leaves 2.5x of that bound (measured: 6e-8 to 8e-8 with the default, avx2
# and avx512 kernels, MADPO, one batch vs one pair per micro-batch); a real bug (a micro-batch
# dropped or counted twice, a wrong denominator) is off by >= 1 / (number of micro-batches).
GRADIENT_RTOL = 1e-4


def assert_same_gradients(a, b, rtol=GRADIENT_RTOL):
    """Two recorded steps' gradients agree tensor by tensor within ``rtol`` of the step's whole
    gradient norm. (Weights after AdamW are not compared: its first step maps each gradient to about
    +-lr whatever its size, so a last-bit difference in a near-zero gradient is a full-size
    difference in the weight.)"""
    import torch

    assert a.keys() == b.keys() and a, (sorted(a)[:3], sorted(b)[:3])
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in a.values()))
    assert norm > 0
    for key in a:
        diff = float((a[key].double() - b[key].double()).norm())
        assert diff <= rtol * float(norm), f"{key}: |difference| {diff:.3g} > {rtol} x |gradient| {float(norm):.3g}"


def adamw_divergence_bound(steps, lr, betas=(0.9, 0.999)):
    """How far apart one weight can drift in two runs of ``steps`` AdamW steps whose gradients
    differ only by rounding: at step t Adam moves a weight by at most lr * B_t, with
    B_t = (1 - b1) / (1 - b1**t) * sqrt(sum_k<t (b1**2 / b2)**k) * sqrt((1 - b2**t) / (1 - b2))
    (Cauchy-Schwarz on the bias-corrected moments; B_1 = 1, about 1.05 at t = 11), and a gradient
    near zero may point either way in the two runs. Returns sum_t 2 * lr * B_t."""
    import math

    b1, b2 = betas
    return sum(2 * lr * (1 - b1) / (1 - b1 ** t) * math.sqrt(sum((b1 * b1 / b2) ** k for k in range(t)))
               * math.sqrt((1 - b2 ** t) / (1 - b2)) for t in range(1, steps + 1))


def rows(directory):
    """The rows of ``directory/metrics.jsonl`` without timings and run ids."""
    import json
    from pathlib import Path

    return [{k: v for k, v in json.loads(line).items() if not k.startswith("timing/") and k != "run_id"}
            for line in Path(directory, "metrics.jsonl").read_text().splitlines()]


def play(trainer, indices, epoch=0, threshold="config", split="train"):
    """The episodes of ``indices`` (rows of the train table) as the trainer's training plays them."""
    from comlrl.engine.collect import train_seeds

    table = trainer._table(split)
    if threshold == "config":
        threshold = trainer.args.early_termination_threshold
    return trainer._collector(table).play(trainer._batch(table, indices), num_generations=trainer.args.num_generations,
                                          num_turns=trainer.args.num_turns,
                                          seed_of=train_seeds(trainer.args.seed, epoch), threshold=threshold)


ROOT = Path(__file__).resolve().parents[1]


def write_config(tmp_path: Path, args: str = "", trainer_extra: str = "") -> Path:
    """A `comlrl train` config for the seed task on the tiny model (``args``: more lines under
    ``args:``; ``trainer_extra``: more lines under ``trainer:``)."""
    config = tmp_path / "config.yaml"
    config.write_text(f"""trainer:
  name: MAGRPO
  agent_model: tiny
  reward_func: comlrl.testing:length_ratio_reward
  train_dataset: {ROOT / 'examples' / 'configs' / 'seed_prompts.jsonl'}
{trainer_extra}  args:
    num_turns: 1
    max_new_tokens: 8
{args}""")
    return config


# --- worker processes without their imports ------------------------------------------------------------

_FORK_SERVER = []  # the forkserver context, made on first use
_LIVE = []         # every process forked, so that none outlives this one
_PRELOAD = ["torch", "safetensors.torch", "transformers", "transformers.models.qwen2.modeling_qwen2", "comlrl",
            "comlrl.testing", "comlrl.trainers.reinforce", "comlrl.trainers.actor_critic",
            "comlrl.trainers.preference", "comlrl.cli", "comlrl.tracking.mlflow", "mlflow"]


def forked(target, run_dir, *args, cwd=None):
    """A started process running ``target(run_dir, *args)`` (a function of a module in tests/, e.g.
    ``kill_worker.main``), forked from a server that imported torch, transformers and comlrl once
    (:data:`_PRELOAD`): each run is a process of its own, killed with SIGKILL as any, but without
    5-8 s of imports per run. It works in ``cwd`` (default: this process's) with this process's
    environment as it is now for what reads it at run time; what a module read when the server
    imported it (HF_HUB_OFFLINE, OMP_NUM_THREADS: tests/conftest.py sets them first) is the
    server's. The child appends its stdout and stderr to ``RUN_DIR/worker.out`` and
    ``RUN_DIR/worker.err`` (:func:`worker_errors`). :func:`finish` waits for it; any still running
    when this process exits is killed (never waited for)."""
    import atexit
    import multiprocessing
    import os

    if not _FORK_SERVER:
        context = multiprocessing.get_context("forkserver")
        # Modules the server can import from its own sys.path (Python 3.11's server does not get
        # this process's, so tests/ is not on it: the workers themselves are imported per child).
        context.set_forkserver_preload(_PRELOAD)
        _FORK_SERVER.append(context)
        atexit.register(_kill_live)  # after multiprocessing's own exit handler, so it runs first
    proc = _FORK_SERVER[0].Process(target=_in_child, args=(dict(os.environ), str(cwd or os.getcwd()), target,
                                                           str(run_dir), *args))
    proc.start()
    _LIVE.append(proc)
    return proc


def finish(proc, timeout: float = 600):
    """Wait up to ``timeout`` s for a :func:`forked` process; kill it if it still runs. Its exit
    code (negative: the signal that ended it)."""
    proc.join(timeout)
    stop(proc)
    return proc.exitcode


def run_forked(target, run_dir, *args, timeout: float = 600) -> None:
    """:func:`forked`, waited for (:func:`finish`); fails with the worker's stderr unless it exited 0."""
    code = finish(forked(target, run_dir, *args), timeout)
    assert code == 0, f"exit {code}: {worker_errors(run_dir)}"


def stop(proc) -> None:
    """SIGKILL a :func:`forked` process if it still runs, and reap it."""
    if proc.is_alive():
        proc.kill()
    proc.join()


def _kill_live() -> None:
    for proc in _LIVE:
        stop(proc)


def _in_child(environ, cwd, target, run_dir, *args):
    import os

    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    for fd, name in ((1, "worker.out"), (2, "worker.err")):
        os.dup2(os.open(Path(run_dir) / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
    target(Path(run_dir), *args)


def run_cli(_run_dir: Path, argv: list) -> None:
    """``comlrl.cli.main(argv)`` as a forked process's whole life (:func:`forked`): its exit status
    is the command's (multiprocessing takes SystemExit's code, argparse's exits included), after
    the exit handlers a real interpreter exit runs."""
    import atexit
    import os
    import sys

    from comlrl.cli import main

    os.environ["COMLRL_DISABLE_PROGRESS"] = "1"
    code = 1
    try:
        code = main(argv)
    except SystemExit as stop_:  # argparse: --help, usage errors
        code = stop_.code
    finally:  # what a real exit of `comlrl` runs (a forked child's own exit skips it)
        atexit._run_exitfuncs()
    sys.exit(code)


def worker_errors(run_dir) -> str:
    """The end of what the workers forked for ``run_dir`` wrote to stderr."""
    err = Path(run_dir) / "worker.err"
    return err.read_text(errors="replace")[-3000:] if err.exists() else ""

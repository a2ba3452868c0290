"""One epoch of the code task on the public ``comlrl==1.4.3`` MAGRPOTrainer, its reward run the way
CoMLRL's task repositories run it: ``exec()`` in this process under ``signal.alarm`` (a peer of
benchmarks/code_epoch.py).

    /tmp/venv-comlrl143/bin/python benchmarks/peers/comlrl143_code.py --model-dir DIR --rows-json ROWS \\
        --max-new-tokens 48 --temperature 0.6 --top-p 0.6 --top-k 50 --lr 1e-4 --advantage-normalization ...

Runs in its own virtual environment (see benchmarks/README.md); nothing of the package is patched.
``ROWS`` is a JSON list of the task's rows (``prompt``, ``entry_point``, ``test``, ...), each with
``"_prompts": [agent 1's prompt, agent 2's prompt]`` as this tree's formatters wrote them, so both
sides sample from the same prompt text: the formatters here return those strings.

Phases, measured from outside the package: ``rollout`` is the time in the trainer's
``_generate_completions`` (tokenising, ``model.generate``, decoding; wrapped on the instance at
run time), ``generate`` the part of it inside the agents' ``generate`` (wrapped the same way),
``reward`` the time in the reward function's calls, ``update`` the rest of ``train()`` (returns,
advantages, the loss, backward and AdamW steps, bookkeeping). Prints one JSON line.

The reward, :func:`exec_alarm_reward`, is this project's own code written to score as the
repositories' aux + main reward does (LLM_Collab_Code_Generation ``rewards/``, max 4.0):

    +0.4  agent 1's completion defines ``aux`` with a ``return`` of something (optional)
    +0.6  agent 2's completion defines the entry point with a ``return``      (missing: stop)
    +0.5  the joint program parses                                           (not: stop)
    +1.0 x the fraction of the assert lines of ``check(candidate)`` that pass, each one on its own
          alarm, after one ``exec`` of the program into a namespace holding ``math``; a line
          ``assert f(args) == expected`` also evaluates the call and the expected value first, as
          theirs does; testing stops after 3 timeouts
    with a test passed and ``aux`` defined, if the main function calls ``aux``: +0.5, +1.0 unless it
    only wraps it (``return aux(...)`` / ``r = aux(...)`` + ``return r``), -0.5 for a bare
    ``aux(...)`` line

The joint program is the prompt's import lines, then every function of agent 1's completion, then
every function of agent 2's (markdown fences dropped; other text dropped), as theirs builds it.
Differences from theirs: functions are found by indentation only (no natural-language filter), the
program's ``exec`` is under the alarm too (theirs runs it without one), the alarm is
``--test-timeout`` seconds (theirs 10; the driver passes the sandbox's 5), the program's prints are
swallowed (theirs print them; their own logging is off by default, ``VERBOSE = False`` from the
configs), and the "result ignored" check matches any bare ``aux(...)`` statement line (theirs
matches a narrower pattern). Like theirs and unlike this tree's code_collab_reward (which parses),
a function is "defined" when its def line and a ``return`` are there, so a main function with a
syntax error in it earns the +0.6 here (1.0 in all) and not in ours (0.4). On the generated task's
reference answers and seven variants of each (wrapper, no helper, fenced, wrong helper, ignored
result, an endless loop) the two rewards agree on every joint answer but that one.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import math
import random
import re
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, parser, peak_rss_mb, setup  # noqa: E402

# --- the reward: exec under signal.alarm, in this process -------------------------------------------

_DEF = re.compile(r"^(\s*)def\s+(\w+)\s*\(")
_IMPORT = re.compile(r"^(from\s+[\w.]+\s+import\s+.+|import\s+[\w.,\s]+)$")
_CALL_EQ = re.compile(r"assert\s+(\w+\(([^)]*)\))\s*==\s*(.+)")
MAX_TIMEOUTS = 3


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout()


def _functions(text: str) -> list[tuple[str, str]]:
    """``(name, source)`` of every ``def`` in ``text`` (fences dropped): the def line and the lines
    after it that are blank or indented deeper."""
    lines = [ln for ln in (text or "").splitlines() if not ln.strip().startswith("```")]
    out, i = [], 0
    while i < len(lines):
        m = _DEF.match(lines[i])
        if not m:
            i += 1
            continue
        indent, j = len(m.group(1)), i + 1
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            j += 1
        body = "\n".join(ln[indent:] if ln[:indent].isspace() else ln for ln in lines[i:j]).rstrip()
        out.append((m.group(2), body))
        i = j
    return out


def _named(functions: list[tuple[str, str]], name: str) -> str:
    return next((src for n, src in functions if n == name), "")


def _defined(source: str) -> bool:
    return bool(source) and re.search(r"\breturn\s+\S", source) is not None


def _body_lines(source: str) -> list[str]:
    """The statements of a function's source as stripped lines: no def line, comments, docstrings."""
    out, quote = [], None
    for line in source.splitlines()[1:]:
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if quote:
            if quote in s:
                quote = None
            continue
        if s[:3] in ('"""', "'''"):
            if not (len(s) > 3 and s.endswith(s[:3])):
                quote = s[:3]
            continue
        out.append(s)
    return out


def _wrapper(source: str, aux: str) -> bool:
    body = _body_lines(source)
    if not body:
        return True
    if len(body) == 1:
        return body[0].startswith("return ") and aux in body[0]
    if len(body) == 2:
        m = re.match(rf"(\w+)\s*=\s*{aux}\s*\(", body[0])
        return bool(m) and body[1] == f"return {m.group(1)}"
    return False


def _tests(test: str, entry: str) -> list[str]:
    m = re.search(r"def check\(candidate\):(.*?)(?=\n\ndef|\Z)", test or "", re.S)
    if not m:
        return []
    found = [ln.strip() for ln in m.group(1).splitlines() if ln.strip().startswith("assert") and "candidate" in ln]
    return [t.replace("candidate", entry) for t in dict.fromkeys(found)]


def _score(aux_text: str, main_text: str, row: dict, timeout: int, counts: dict) -> float:
    entry, aux = str(row["entry_point"]), "aux"
    firsts, seconds = _functions(aux_text), _functions(main_text)
    aux_src, main_src = _named(firsts, aux), _named(seconds, entry)
    reward = 0.4 if _defined(aux_src) else 0.0
    if not _defined(main_src):
        return reward
    reward += 0.6
    imports = list(dict.fromkeys(ln.strip() for ln in str(row["prompt"]).splitlines() if _IMPORT.match(ln.strip())))
    program = "\n\n".join(p for p in ["\n".join(imports)] + [s for _, s in firsts] + [s for _, s in seconds] if p)
    try:
        ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return reward
    reward += 0.5
    tests = _tests(str(row["test"]), entry)
    if not tests:
        return reward
    namespace, passed, timeouts = {"math": math}, 0, 0
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        signal.alarm(timeout)
        exec(program, namespace)
        signal.alarm(0)
        for test in tests:
            if timeouts >= MAX_TIMEOUTS:
                break
            try:
                signal.alarm(timeout)
                m = _CALL_EQ.match(test)
                if m:
                    eval(m.group(1), namespace)
                    eval(m.group(3), namespace)
                exec(test, namespace)
                passed += 1
            except _Timeout:
                timeouts += 1
            except (Exception, SystemExit):
                pass
            finally:
                signal.alarm(0)
        reward += passed / len(tests)
    except (_Timeout, Exception, SystemExit):
        pass
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    counts["tests"] += len(tests)
    counts["passed"] += passed
    counts["timeouts"] += timeouts
    if passed and aux_src and re.search(rf"\b{aux}\s*\(", main_src):
        reward += 0.5
        reward += 0.0 if _wrapper(main_src, aux) else 1.0
        if any(re.fullmatch(rf"{aux}\s*\(.*\)\s*;?", s) for s in _body_lines(main_src)):
            reward -= 0.5
    return reward


def exec_alarm_reward(timeout: int):
    """``reward(completions1, completions2, *, batch_items=None)`` as the 1.4.3 trainer calls it (one
    joint answer per call), timed; ``reward.seconds`` / ``.calls`` / ``.rewards`` / ``.counts``."""
    def reward(completions1, completions2, *, batch_items=None):
        start = time.perf_counter()
        row = batch_items[0]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            out = [_score(a, b, row, timeout, reward.counts) for a, b in zip(completions1, completions2)]
        reward.seconds += time.perf_counter() - start
        reward.calls += 1
        reward.rewards.extend(out)
        return out

    reward.seconds, reward.calls, reward.rewards = 0.0, 0, []
    reward.counts = {"tests": 0, "passed": 0, "timeouts": 0}
    return reward


def _timed(fn, box: dict, key: str):
    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            box[key] += time.perf_counter() - start
    return wrapped


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows-json", required=True, help="the task rows, each with _prompts (see the docstring)")
    p.add_argument("--test-timeout", type=int, default=5, help="signal.alarm seconds per exec (theirs: 10)")
    args = p.parse_args()
    setup(args)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import comlrl
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    rows = json.loads(Path(args.rows_json).read_text())
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    reward = exec_alarm_reward(args.test_timeout)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    agents = [AutoModelForCausalLM.from_pretrained(args.model_dir) for _ in range(2)]
    config = MAGRPOConfig(num_train_epochs=1, agent_learning_rate=args.lr, num_agents=2, agent_devices="cpu",
                          num_generations=args.num_generations, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, num_turns=1,
                          eval_interval=0, early_termination_threshold=None,
                          rollout_buffer_size=args.rollout_buffer_size,
                          train_batch_size=args.train_batch_size or args.rollout_buffer_size,
                          advantage_normalization=args.advantage_normalization, logging_steps=1)
    trainer = MAGRPOTrainer(agents=agents, tokenizer=tokenizer, reward_func=reward, args=config,
                            formatters=[lambda item, external_prompts=None: item["_prompts"][0],
                                        lambda item, external_prompts=None: item["_prompts"][1]],
                            train_dataset=Dataset.from_list(rows))
    trainer.verbose = False  # no progress bar
    box = {"rollout": 0.0, "generate": 0.0}
    trainer._generate_completions = _timed(trainer._generate_completions, box, "rollout")
    for agent in trainer.agents:
        agent.generate = _timed(agent.generate, box, "generate")
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start
    update = elapsed - box["rollout"] - reward.seconds
    emit({
        "framework": f"comlrl {getattr(comlrl, '__version__', '1.4.3')}", "epochs": 1, "elapsed_s": elapsed,
        "seconds_per_epoch": elapsed, "rows": len(rows), "env_steps": trainer.env_step,
        "env_steps_per_s": trainer.env_step / elapsed,
        "phase_seconds_per_epoch": {"rollout": box["rollout"], "reward": reward.seconds, "update": update},
        "generate_s": box["generate"], "reward_calls": reward.calls,
        "reward_mean": sum(reward.rewards) / max(len(reward.rewards), 1), "tests": reward.counts,
        "peak_rss_mb": peak_rss_mb(), "peak_gpu_mb": None,
    })


if __name__ == "__main__":
    main()

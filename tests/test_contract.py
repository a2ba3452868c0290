"""The run loop and a trainer meet at one public contract (comlrl/engine/schedule.py): the loop
uses only what ``LoopTrainer`` lists of the trainer, a trainer only what ``TrainingLoop`` lists of
the loop, and every trainer family provides ``LoopTrainer``'s methods with signatures the loop can
call. Read from the source (``ast``) for the two directions of use, from the classes for the rest.
The played buffer between them: the engine's progress through a step apart from the family's own
record of it, and each family's typed data.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
from pathlib import Path
from typing import Iterator, Protocol

import pytest

from comlrl.engine.loop import RunLoop
from comlrl.engine.schedule import EpochSchedule, LoopTrainer, TrainingLoop
from comlrl.extend import Trainer

PACKAGE = Path(__file__).resolve().parents[1] / "comlrl"
LOOP_MODULE = PACKAGE / "engine" / "loop.py"
TRAINER_MODULES = sorted((PACKAGE / "trainers").rglob("*.py")) + [PACKAGE / "engine" / "trainer.py"] \
    + sorted((PACKAGE / "algorithms").rglob("*.py"))

#: The families (imported from their public packages); every other Trainer they export is checked too.
FAMILIES = {
    "comlrl.trainers.reinforce": ["MAGRPOTrainer", "MAREINFORCETrainer", "MARLOOTrainer", "MAReMaxTrainer",
                                  "CentralizedMAGRPOTrainer", "MAHAGRPOTrainer"],
    "comlrl.trainers.actor_critic": ["IACTrainer", "MAACTrainer"],
    "comlrl.trainers.preference": ["MADPOTrainer", "MARLHFTrainer", "MADPOIterTrainer", "MARLHFIterTrainer"],
    "comlrl.algorithms": ["DrGRPOTrainer"],
}


def _members(protocol: type) -> tuple[dict[str, object], set[str]]:
    """A protocol's methods and properties by name, and its data attributes (annotations), its
    base protocols' included (LoopTrainer has EpochSchedule's)."""
    methods, data = {}, set()
    for cls in reversed([c for c in protocol.__mro__ if getattr(c, "_is_protocol", False) and c is not Protocol]):
        methods.update({name: value for name, value in vars(cls).items()
                        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))})
        data |= set(vars(cls).get("__annotations__", {}))
    return methods, data


def _names(protocol: type) -> set[str]:
    methods, data = _members(protocol)
    return set(methods) | data


# --- reading attribute uses from the source --------------------------------------------------------------

def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _uses(path: Path, is_object, aliases_of) -> list[tuple[int, str]]:
    """(line, attribute) of every ``X.attr`` and ``getattr(X, "attr")`` in ``path`` whose ``X`` is
    the object: ``is_object(node, aliases)`` with ``aliases_of(function)`` the local names that
    hold it in the enclosing function (nested functions and lambdas included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for function in _functions(tree):
        aliases = aliases_of(function)
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and is_object(node.value, aliases):
                found.add((node.lineno, node.attr))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr",
                  "setattr", "hasattr", "delattr") and node.args and is_object(node.args[0], aliases)):
                name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "?"
                found.add((node.lineno, str(name)))
    return sorted(found)


def _is_self_t(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "t" and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


def _annotated(arg: ast.arg, names: tuple[str, ...]) -> bool:
    return arg.annotation is not None and any(n in ast.unparse(arg.annotation) for n in names)


def _trainer_aliases(function: ast.AST) -> set[str]:
    """Names for the trainer in one of the loop's functions: ``t = self.t``, a parameter
    annotated as the trainer (``__init__``'s ``trainer``), and the schedule an epoch runs on
    (:func:`_schedule_aliases`: the trainer or a phase's)."""
    aliases = {a.arg for a in function.args.args + function.args.kwonlyargs
               if _annotated(a, ("LoopTrainer", "Trainer"))}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and _is_self_t(node.value):
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return aliases | _schedule_aliases(function)


def _schedule_aliases(function: ast.AST) -> set[str]:
    """Names for an epoch's schedule in one of the loop's functions: a parameter annotated as an
    EpochSchedule, and a name bound to a choice of one (``s = t if schedule is None else schedule``)."""
    aliases = {a.arg for a in function.args.args + function.args.kwonlyargs if _annotated(a, ("EpochSchedule",))}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.IfExp) and \
                {n.id for n in (node.value.body, node.value.orelse) if isinstance(n, ast.Name)} & aliases:
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return aliases


def _loop_aliases(function: ast.AST) -> set[str]:
    """Names for the run loop in a trainer's function: a parameter named ``loop`` or annotated as
    a loop, and a name bound to ``RunLoop(...)``."""
    aliases = {a.arg for a in function.args.args + function.args.kwonlyargs
               if a.arg == "loop" or _annotated(a, ("TrainingLoop", "RunLoop"))}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and ast.unparse(node.value.func).endswith("RunLoop"):
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return aliases


def _loop_uses_of_the_trainer(path: Path = LOOP_MODULE) -> list[tuple[int, str]]:
    return _uses(path, lambda node, aliases: _is_self_t(node) or (isinstance(node, ast.Name) and node.id in aliases),
                 _trainer_aliases)


def _trainer_uses_of_the_loop(path: Path) -> list[tuple[int, str]]:
    return _uses(path, lambda node, aliases: isinstance(node, ast.Name) and node.id in aliases, _loop_aliases)


def test_the_loop_calls_no_private_trainer_attribute():
    private = [(line, attr) for line, attr in _loop_uses_of_the_trainer() if attr.startswith("_")]
    assert not private, f"engine/loop.py uses private trainer attributes (line, name): {private}"


def test_the_loop_uses_only_what_the_contract_lists():
    allowed = _names(LoopTrainer)
    outside = [(line, attr) for line, attr in _loop_uses_of_the_trainer() if attr not in allowed]
    assert not outside, (f"engine/loop.py uses trainer attributes LoopTrainer (engine/schedule.py) does not list "
                         f"(line, name): {outside}; add them to the contract, public and documented")


def test_an_epoch_uses_only_the_epoch_schedule_of_its_schedule():
    """What the loop calls on an epoch's schedule (a phase's, MARLHF's online phase) is
    EpochSchedule's: the state, evaluation and logging stay the trainer's."""
    uses = _uses(LOOP_MODULE, lambda node, aliases: isinstance(node, ast.Name) and node.id in aliases,
                 _schedule_aliases)
    assert {"epoch_order", "buffer_prompts", "eval_due", "train_buffer"} <= {attr for _, attr in uses}
    outside = [(line, attr) for line, attr in uses if attr not in _names(EpochSchedule)]
    assert not outside, f"engine/loop.py uses schedule attributes EpochSchedule does not list: {outside}"


def test_marlhf_s_online_phase_is_an_epoch_schedule_and_marlhf_does_not_switch_on_it():
    """MARLHF runs its online epochs on OnlinePhase (the inner trainer's buffers); the MARLHF
    trainer's own schedule methods are MADPO's, not forwards chosen by phase."""
    from comlrl.trainers.preference import MADPOTrainer, MARLHFTrainer
    from comlrl.trainers.preference.marlhf import OnlinePhase

    assert not _contract_problems(OnlinePhase, EpochSchedule)
    for name in _names(EpochSchedule):
        assert getattr(MARLHFTrainer, name) is getattr(MADPOTrainer, name), name


def test_no_trainer_calls_into_the_loop_s_privates():
    # run(): what Trainer.train calls on the RunLoop it builds; the rest is TrainingLoop's
    allowed = _names(TrainingLoop) | {"run"}
    private, outside = [], []
    for path in TRAINER_MODULES:
        for line, attr in _trainer_uses_of_the_loop(path):
            where = (str(path.relative_to(PACKAGE.parent)), line, attr)
            (private if attr.startswith("_") else outside if attr not in allowed else []).append(where)
    assert not private, f"trainers use private loop attributes (file, line, name): {private}"
    assert not outside, f"trainers use loop attributes TrainingLoop does not list (file, line, name): {outside}"


def test_the_readers_find_the_uses():
    """The checks above read something: the loop's calls of the schedule, the families' callbacks."""
    loop_uses = {attr for _, attr in _loop_uses_of_the_trainer()}
    assert {"run_schedule", "train_buffer", "save_run_checkpoint", "open_run_trackers", "state"} <= loop_uses
    trainer_uses = {attr for path in TRAINER_MODULES for _, attr in _trainer_uses_of_the_loop(path)}
    assert {"run_epoch", "checkpoint", "log", "checkpoint_dir", "run"} <= trainer_uses


def test_the_readers_catch_private_uses(tmp_path):
    """Code of the old shape (the loop calling private trainer methods through ``self.t`` or a
    local alias, a family calling a private method of its ``loop``) is found."""
    old_loop = tmp_path / "loop.py"
    old_loop.write_text("class RunLoop:\n"
                        "    def __init__(self, trainer: 'Trainer'):\n        trainer._open()\n"
                        "    def _one_epoch(self, progress):\n        t = self.t\n        t._buffer([], 0, None)\n"
                        "        self.t._write(1, None)\n        getattr(t, '_done')()\n")
    assert {a for _, a in _loop_uses_of_the_trainer(old_loop)} == {"_open", "_buffer", "_write", "_done"}
    old_family = tmp_path / "family.py"
    old_family.write_text("class F:\n    def _schedule(self, loop, progress):\n        loop._one_epoch(progress)\n"
                          "    def train(self):\n        loop = RunLoop(self)\n        loop._opened()\n")
    assert {a for _, a in _trainer_uses_of_the_loop(old_family)} == {"_one_epoch", "_opened"}


# --- every family provides the contract ---------------------------------------------------------------

def _families() -> dict[str, type]:
    found = {}
    for module_name, expected in FAMILIES.items():
        module = importlib.import_module(module_name)
        for name in set(expected) | set(getattr(module, "__all__", ())):
            value = getattr(module, name)
            if inspect.isclass(value) and issubclass(value, Trainer):
                found[name] = value
        missing = set(expected) - set(found)
        assert not missing, f"{module_name} no longer exports {sorted(missing)}"
    return found


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _incompatible(declared: inspect.Signature, actual: inspect.Signature) -> list[str]:
    """Why a call made as ``declared`` says may fail on ``actual`` (empty: it cannot)."""
    wanted = [p for p in declared.parameters.values() if p.kind in _POSITIONAL]
    params = list(actual.parameters.values())
    given = [p for p in params if p.kind in _POSITIONAL]
    var_positional = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    problems = []
    for k, want in enumerate(wanted):
        if k >= len(given):
            if not var_positional:
                problems.append(f"takes no parameter {want.name!r}")
            continue
        have = given[k]
        if have.name != want.name and have.kind is not inspect.Parameter.POSITIONAL_ONLY:
            problems.append(f"parameter {k} is {have.name!r}, not {want.name!r} (the loop may pass it by name)")
        if want.default is not inspect.Parameter.empty and have.default is inspect.Parameter.empty:
            problems.append(f"{have.name!r} needs a default (the loop may leave it out)")
    for extra in given[len(wanted):] + [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]:
        if extra.default is inspect.Parameter.empty:
            problems.append(f"parameter {extra.name!r} is not in the contract and has no default")
    return problems


def _contract_problems(cls: type, protocol: type = LoopTrainer) -> list[str]:
    methods, _ = _members(protocol)
    problems = []
    for name, declared in methods.items():
        actual = inspect.getattr_static(cls, name, None)
        if isinstance(declared, property):
            if not isinstance(actual, property):
                problems.append(f"{name}: not a property")
            continue
        if not inspect.isfunction(actual):
            problems.append(f"{name}: missing or not a plain method ({type(actual).__name__})")
            continue
        problems += [f"{name}: {p}" for p in _incompatible(inspect.signature(declared), inspect.signature(actual))]
    return problems


@pytest.mark.parametrize("name", sorted(name for names in FAMILIES.values() for name in names))
def test_every_family_provides_the_contract(name):
    families = _families()
    assert name in families
    assert not _contract_problems(families[name]), (name, _contract_problems(families[name]))
    assert isinstance(families[name].algorithm_name, str)


def test_every_exported_trainer_provides_the_contract():
    problems = {name: p for name, cls in _families().items() if (p := _contract_problems(cls))}
    assert not problems, problems


def test_a_family_that_breaks_the_contract_is_caught():
    class Broken(Trainer):
        def run_schedule(self, loop):             # no progress
            pass

        def eval_due(self, first, count):         # renamed parameter
            return False

        def train_buffer(self, indices, epoch, timer, extra):  # a parameter the loop never passes
            return {}

        total_steps = None                        # not a method

    problems = _contract_problems(Broken)
    assert any(p.startswith("run_schedule: takes no parameter 'progress'") for p in problems), problems
    assert any(p.startswith("eval_due: parameter 1 is 'first'") for p in problems), problems
    assert any(p.startswith("train_buffer: parameter 'extra'") for p in problems), problems
    assert any(p.startswith("total_steps: missing") for p in problems), problems
    assert not _contract_problems(Trainer)


def test_the_run_loop_provides_what_trainers_use():
    assert not _contract_problems(RunLoop, TrainingLoop)
    assert "self.checkpoint_dir =" in inspect.getsource(RunLoop.__init__)


def test_the_contract_is_public_and_documented():
    for protocol in (LoopTrainer, TrainingLoop):
        methods, _ = _members(protocol)
        assert methods
        for name, value in methods.items():
            function = value.fget if isinstance(value, property) else value
            assert (function.__doc__ or "").strip(), f"{protocol.__name__}.{name} has no docstring"


def test_a_built_trainer_is_a_loop_trainer(make_trainer):
    """The data attributes (set in __init__) too: runtime_checkable checks every member."""
    trainer = make_trainer()
    try:
        assert isinstance(trainer, LoopTrainer)
    finally:
        trainer.close()


# --- the played buffer: the family's data and step parts apart from the engine's progress (issue 30) ------

def _family_trainer(kind: str, model_path, tokenizer, tmp_path, **overrides):
    """A tiny trainer of family ``kind`` ("magrpo", "mahagrpo", "iac", "maac") on 4 seed prompts, one epoch."""
    from transformers import AutoModelForCausalLM

    from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer, MAHAGRPOConfig, MAHAGRPOTrainer

    from helpers import SEED_PROMPTS, TEST_SETTINGS, length_ratio_reward

    kwargs = dict(agents=[AutoModelForCausalLM.from_pretrained(model_path) for _ in range(2)], tokenizer=tokenizer,
                  reward_func=length_ratio_reward, train_dataset=[{"prompt": p} for p in SEED_PROMPTS[:4]])
    if kind in ("iac", "maac"):
        settings = dict(num_turns=1, num_generations=2, num_train_epochs=1, max_new_tokens=8, rollout_buffer_size=4,
                        train_batch_size=4, eval_interval=0, early_termination_threshold=None,
                        output_dir=str(tmp_path / kind), **overrides)
        if kind == "iac":
            return IACTrainer(critic_model=model_path, args=IACConfig(**settings), **kwargs)
        return MAACTrainer(critic_model=model_path, args=MAACConfig(**settings), **kwargs)
    settings = dict(TEST_SETTINGS, num_generations=2, num_train_epochs=1, max_new_tokens=8, agent_learning_rate=1e-3,
                    output_dir=str(tmp_path / kind))
    settings.update(overrides)
    if kind == "mahagrpo":
        return MAHAGRPOTrainer(args=MAHAGRPOConfig(**settings), **kwargs)
    return MAGRPOTrainer(args=MAGRPOConfig(**settings), **kwargs)


@pytest.mark.parametrize("kind", ["magrpo", "mahagrpo"])
def test_the_engine_keeps_its_step_progress_apart_from_the_family_s_step_parts(kind, model_path, tokenizer, tmp_path,
                                                                               monkeypatch):
    """Interrupted just after an optimizer step finished (as its "update" phase closes): the engine
    holds that step's metrics in ``buffer.finished_step``, the family's ``step_parts`` hold only
    what the family wrote (MAGRPO: agent -> its update's metrics; MAHAGRPO: its
    SequentialStepParts by position), and train() again counts the step without redoing it. Every
    step starts with neither record, and both are cleared once the step is counted."""
    from comlrl.engine.timing import PhaseTimer
    from comlrl.trainers.reinforce import SequentialStepParts

    trainer = _family_trainer(kind, model_path, tokenizer, tmp_path, rollout_buffer_size=2, train_batch_size=1)
    cls, calls, interrupted = type(trainer), [], []
    step, phase = cls.optimizer_step, PhaseTimer.__call__

    def recorded(self, buffer, groups):
        assert buffer.step_parts is None and buffer.finished_step is None, (buffer.step_parts, buffer.finished_step)
        metrics = step(self, buffer, groups)
        calls.append((buffer, metrics))
        return metrics

    @contextlib.contextmanager
    def interrupted_after_the_first_step(self, name):
        with phase(self, name):
            yield
        if name == "update" and not interrupted:
            interrupted.append(name)
            raise KeyboardInterrupt

    monkeypatch.setattr(cls, "optimizer_step", recorded)
    monkeypatch.setattr(PhaseTimer, "__call__", interrupted_after_the_first_step)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        (buffer, metrics), = calls
        assert buffer.finished_step is metrics and buffer.steps_done == 0 and trainer.state.global_step == 1
        if kind == "magrpo":
            assert set(buffer.step_parts) == {0, 1}
        else:
            parts = buffer.step_parts
            assert isinstance(parts, SequentialStepParts)
            assert set(parts.updates) == {0, 1} and set(parts.weights) == {0}  # the last agent's ratio is not needed
            assert {metrics[f"agent_{a}/update_position"] for a in range(2)} == {0.0, 1.0}
        trainer.train()  # the notebook habit: call it again
        assert len(calls) == trainer.state.global_step == 4  # 2 buffers of 2 steps; the finished one not redone
        assert buffer.steps_done == 2 and buffer.step_parts is None and buffer.finished_step is None
        assert [b is buffer for b, _ in calls] == [True, True, False, False] and calls[2][0] is calls[3][0]
    finally:
        trainer.close()


@pytest.mark.parametrize("kind", ["magrpo", "mahagrpo", "iac", "maac"])
def test_each_family_collects_its_typed_data(kind, model_path, tokenizer, tmp_path):
    """``collect`` hands the family's optimizer steps its own dataclass, on a process with prompts
    and on one without; the actor-critic fields are ``[agent][turn] -> [R_t]``."""
    from comlrl.engine.timing import PhaseTimer
    from comlrl.trainers.actor_critic import ActorCriticBufferData, MAACBufferData
    from comlrl.trainers.reinforce import GroupBufferData

    expected = {"magrpo": GroupBufferData, "mahagrpo": GroupBufferData, "iac": ActorCriticBufferData,
                "maac": MAACBufferData}[kind]
    trainer = _family_trainer(kind, model_path, tokenizer, tmp_path)
    try:
        buffer = trainer.collect([0, 1], 0, PhaseTimer())
        data = buffer.data
        assert type(data) is expected and buffer.step_parts is None and buffer.finished_step is None
        rows = 2 * trainer.args.num_generations
        if expected is GroupBufferData:
            assert [[len(r) for r in turn] for turn in data.returns] == [[rows, rows]]  # [turn][agent]
            assert data.old_log_probs == {} and data.sampled_policy_read == set()  # filled by the clipped update
        else:
            for name in ("values", "targets", "raw_advantages", "advantages", "shaped"):
                assert [[len(t) for t in per_turn] for per_turn in getattr(data, name)] == [[rows], [rows]], name
            assert data.kl == [[], []]  # no reference KL
            if expected is MAACBufferData:
                assert [len(inputs.texts) for inputs in data.critic_inputs] == [rows]
        assert type(trainer.collect([], 0, PhaseTimer()).data) is expected
    finally:
        trainer.close()

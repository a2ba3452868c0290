"""Reading checkpoints written by comlrl 1.4.3 (comlrl.checkpoint.legacy).

The fixture under tests/fixtures/comlrl143/ was produced by the real comlrl==1.4.3 package with
tests/fixtures/make_comlrl143_checkpoint.py; expected.json records what it trained and saved.
Every test in this module runs with torch.load guarded so that any call without
weights_only=True fails.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from comlrl.exceptions import CheckpointError
from comlrl.checkpoint.legacy import LegacyCheckpoint, is_legacy_checkpoint, read_legacy_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "comlrl143"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
CHECKPOINT = FIXTURE / EXPECTED["checkpoint"]
STATE = "training_state.pt"
# Config fields 1.4.3 leaves out of a checkpoint because they may change on resume.
PORTABLE = {"num_train_epochs", "num_iterations", "agent_devices", "critic_devices", "reference_devices",
            "comparator_devices", "parallel_training", "reward_model_device", "reference_device",
            "logging_steps", "logging_interval", "verbose"}
_REAL_LOAD = torch.load


def _safe_load_only(*args, **kwargs):
    # pytest.fail raises a BaseException, which the reader's error handling cannot swallow.
    if kwargs.get("weights_only") is not True or kwargs.get("map_location") != "cpu":
        pytest.fail(f"torch.load called without weights_only=True / map_location='cpu': {kwargs}")
    return _REAL_LOAD(*args, **kwargs)


@pytest.fixture(autouse=True)
def only_safe_loads(monkeypatch):
    """Every torch.load in these tests must be a weights_only load; returns the files loaded."""
    calls = []

    def guarded(*args, **kwargs):
        calls.append(args[0])
        return _safe_load_only(*args, **kwargs)

    monkeypatch.setattr(torch, "load", guarded)
    return calls


@pytest.fixture(scope="module")
def checkpoint() -> LegacyCheckpoint:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "load", _safe_load_only)
        return read_legacy_checkpoint(CHECKPOINT)


def sha256_state(state):
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].contiguous()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


# -- the fixture reads back as 1.4.3 wrote it ----------------------------------------------------

def test_reads_with_one_weights_only_load(only_safe_loads):
    read_legacy_checkpoint(CHECKPOINT)
    assert only_safe_loads == [CHECKPOINT / STATE]


def test_counters_identity_and_progress(checkpoint):
    assert checkpoint.path == CHECKPOINT
    assert checkpoint.version == EXPECTED["version"]
    assert checkpoint.trainer_class == EXPECTED["trainer_class"]
    assert checkpoint.sequence == EXPECTED["sequence"]
    assert checkpoint.epoch == EXPECTED["epoch"]
    assert checkpoint.progress == EXPECTED["progress"]
    assert checkpoint.env_step == EXPECTED["env_step"]
    assert checkpoint.run_id == EXPECTED["run_id"]
    assert checkpoint.wandb is None


def test_config_is_the_non_portable_args(checkpoint):
    assert checkpoint.config == {k: v for k, v in EXPECTED["args"].items() if k not in PORTABLE}
    assert checkpoint.config["num_generations"] == 2 and checkpoint.config["max_new_tokens"] == 4
    assert "agent_devices" not in checkpoint.config and "num_train_epochs" not in checkpoint.config


def test_dataset_tokenizers_and_model_groups(checkpoint):
    assert checkpoint.dataset == EXPECTED["dataset"]
    assert [t["class"] for t in checkpoint.tokenizers] == [EXPECTED["tokenizer_class"]] * 2
    assert all(len(v) == 64 for t in checkpoint.tokenizers for k, v in t.items() if k != "class")
    assert checkpoint.model_classes == [a["class"] for a in EXPECTED["agents"]]
    assert checkpoint.other_models == EXPECTED["other_models"]
    assert checkpoint.rng_devices == {"agents.0": "cpu", "agents.1": "cpu"}


def test_agent_weights_are_the_trained_ones(checkpoint):
    assert len(checkpoint.agent_states) == len(EXPECTED["agents"])
    for state, expected in zip(checkpoint.agent_states, EXPECTED["agents"]):
        first = next(iter(state))
        assert first == expected["first_tensor"]
        assert hashlib.sha256(state[first].numpy().tobytes()).hexdigest() == expected["first_tensor_sha256"]
        assert sha256_state(state) == expected["state_sha256"]
        assert all(t.device.type == "cpu" for t in state.values())


def test_states_load_into_fresh_models_and_adamw(checkpoint):
    for state, optimizer_state, expected in zip(checkpoint.agent_states, checkpoint.optimizer_states,
                                                EXPECTED["agents"]):
        model = AutoModelForCausalLM.from_pretrained(FIXTURE / EXPECTED["model"])
        initial = model.state_dict()[expected["first_tensor"]].clone()
        model.load_state_dict(state, strict=True)
        assert not torch.equal(model.state_dict()[expected["first_tensor"]], initial)  # training moved it
        optimizer = torch.optim.AdamW(model.parameters(), lr=EXPECTED["args"]["agent_learning_rate"])
        optimizer.load_state_dict(optimizer_state)
        parameters = list(model.parameters())
        assert len(parameters) == expected["num_optimizer_params"]
        for parameter in parameters:
            slots = optimizer.state[parameter]
            assert slots["exp_avg"].shape == slots["exp_avg_sq"].shape == parameter.shape
            assert [int(slots["step"])] == expected["optimizer_steps"]
        model(torch.tensor([[2, 3, 4]]), labels=torch.tensor([[2, 3, 4]])).loss.backward()
        optimizer.step()  # the restored state is usable


def test_rng_states_are_loadable(checkpoint):
    rng = checkpoint.rng
    random.Random().setstate(rng.python)
    np.random.RandomState().set_state(rng.numpy)
    torch.Generator().set_state(rng.torch)
    assert rng.torch.dtype == torch.uint8 and rng.cuda is None and rng.mps is None


def test_result_is_frozen(checkpoint):
    with pytest.raises(dataclasses.FrozenInstanceError):
        checkpoint.sequence = 3


def test_detects_legacy_checkpoints(tmp_path):
    assert is_legacy_checkpoint(CHECKPOINT) and is_legacy_checkpoint(CHECKPOINT / STATE)
    assert read_legacy_checkpoint(CHECKPOINT / STATE).path == CHECKPOINT
    assert not is_legacy_checkpoint(tmp_path) and not is_legacy_checkpoint(tmp_path / "absent")
    ours = copy_checkpoint(tmp_path)
    (ours / "trainer_state.json").write_text("{}")
    assert not is_legacy_checkpoint(ours) and not is_legacy_checkpoint(ours / STATE)


# -- malformed or hostile input -------------------------------------------------------------------

def copy_checkpoint(tmp_path: Path) -> Path:
    target = tmp_path / "checkpoint-2"
    shutil.copytree(CHECKPOINT, target)
    return target


def tagged(**items):
    return {"__kind__": "dict", "items": [(k, v) for k, v in items.items()]}


def get(node, key):
    return next(v for k, v in node["items"] if k == key)


def put(node, key, value):
    node["items"] = [(k, value if k == key else v) for k, v in node["items"]]
    return node


def raw_state():
    return _REAL_LOAD(CHECKPOINT / STATE, map_location="cpu", weights_only=True)


def planted(tmp_path, encoded) -> Path:
    target = copy_checkpoint(tmp_path)
    torch.save(encoded, target / STATE)
    return target


def refused(path: Path, field: str) -> str:
    with pytest.raises(CheckpointError) as info:
        read_legacy_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and field in message, message
    return message


MARK = "executed"


def _leave_mark(path):
    Path(path).write_text(MARK)


class Payload:
    """Unpickling this runs _leave_mark(target): the classic pickle code-execution attack."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (_leave_mark, (self.target,))


def test_planted_pickle_is_not_executed(tmp_path):
    probe, sentinel = tmp_path / "probe", tmp_path / "sentinel"
    torch.save(put(raw_state(), "version", Payload(probe)), tmp_path / "probe.pt")
    _REAL_LOAD(tmp_path / "probe.pt", weights_only=False)  # the payload is live when fully unpickled
    assert probe.read_text() == MARK
    path = planted(tmp_path, put(raw_state(), "version", Payload(sentinel)))
    assert "refuses to unpickle" in refused(path, STATE)
    assert not sentinel.exists()


def test_missing_truncated_and_empty_files(tmp_path):
    assert "missing" in refused(tmp_path, STATE)
    path = copy_checkpoint(tmp_path)
    data = (path / STATE).read_bytes()
    (path / STATE).write_bytes(data[: len(data) // 2])
    assert "truncated or corrupted" in refused(path, STATE)
    (path / STATE).write_bytes(b"")
    assert "truncated or corrupted" in refused(path, STATE)


@pytest.mark.parametrize("field, value, named", [
    ("version", 2, "'version'"),
    ("version", True, "'version'"),
    ("trainer_class", "", "'trainer_class'"),
    ("sequence", -1, "'sequence'"),
    ("run_id", "not-a-run-id", "'run_id'"),
    ("wandb", tagged(id=5), "'wandb.id'"),
    ("wandb", tagged(id="x1", project=7), "'wandb.project'"),
    ("wandb", tagged(id="x1", entity="a/b"), "'wandb.entity'"),
    ("wandb", tagged(project="p"), "'wandb'"),
    ("wandb", tagged(id="x1", settings=tagged(mode="online")), "'wandb'"),
    ("progress", tagged(kind="magrpo", epoch=-1), "'progress.epoch'"),
    ("progress", tagged(kind="magrpo", epoch=2, step=9), "'progress'"),
    ("config", tagged(temperature=float("nan")), "'config.temperature'"),
    ("config", tagged(temperature=torch.ones(1)), "'config.temperature'"),
    ("config", {"__kind__": "object", "value": 1}, "'config'"),
    ("config", {"items": []}, "'config'"),
    ("config", tagged(x={"__kind__": "numpy", "dtype": "|O", "shape": [1], "data": b"12345678"}), "'config.x'"),
    ("progress", {"__kind__": "record", "class": "os.System", "fields": {}}, "'progress'"),
    ("dataset", tagged(**{"class": "pkg.Data", "length": -3, "fingerprint": None}), "'dataset.length'"),
    ("tokenizers", {"__kind__": "list", "items": [tagged(**{"class": "pkg.Tok", "vocab": "abc"})]},
     "'tokenizers[0].vocab'"),
    ("callbacks", tagged(reward_func=tagged(**{"class": "m.R", "state": tagged()})), "'callbacks'"),
    ("schedulers", tagged(lr_scheduler=tagged()), "'schedulers'"),
    ("extra", 1, "'extra'"),
])
def test_malformed_field_is_refused(tmp_path, field, value, named):
    refused(planted(tmp_path, put(raw_state(), field, value)), named)


def test_unknown_and_missing_top_level_fields(tmp_path):
    raw = raw_state()
    raw["items"].append(("assets", None))
    assert "assets" in refused(planted(tmp_path / "a", raw), STATE)
    raw = raw_state()
    raw["items"] = [(k, v) for k, v in raw["items"] if k != "rng"]
    assert "rng" in refused(planted(tmp_path / "b", raw), STATE)
    raw = raw_state()
    raw["items"].append(("sequence", 2))
    refused(planted(tmp_path / "c", raw), "'sequence': duplicate key")
    refused(planted(tmp_path / "d", {"version": 1}), "unknown encoding kind None")
    refused(planted(tmp_path / "e", [torch.zeros(2)]), "list is not part of the 1.4.3 encoding")


def test_deep_nesting_is_refused(tmp_path):
    deep = 7
    for _ in range(200):
        deep = {"__kind__": "list", "items": [deep]}
    message = refused(planted(tmp_path, put(raw_state(), "config", tagged(deep=deep))), "nested deeper")
    assert "'config.deep[0][0]" in message


def test_nested_model_and_optimizer_fields(tmp_path):
    raw = raw_state()
    agent0 = get(get(get(get(raw, "models"), "agents"), "states")["items"][0], "transformer.wte.weight")
    assert isinstance(agent0, torch.Tensor)
    states = get(get(get(raw, "models"), "agents"), "states")["items"][0]
    put(states, "transformer.wte.weight", "weights")
    refused(planted(tmp_path / "a", raw), "'models.agents.states[0].transformer.wte.weight'")

    raw = raw_state()
    record = get(get(raw, "optimizers"), "optimizers")
    for key in ("classes", "states", "metadata", "training"):
        get(record, key)["items"].pop()
    refused(planted(tmp_path / "b", raw), "'optimizers.optimizers.states': expected one optimizer state per agent")

    raw = raw_state()
    put(get(raw, "rng"), "torch", torch.zeros(3))
    refused(planted(tmp_path / "c", raw), "'rng.torch'")


def test_records_become_plain_dicts_without_imports(tmp_path, monkeypatch):
    def no_imports(*args, **kwargs):
        raise AssertionError(f"import attempted: {args}")

    record = {"__kind__": "record", "class": "comlrl.trainers.reinforce.magrpo.NodeSample",
              "fields": {"agent_idx": 1, "returns": {"__kind__": "list", "items": [0.5]}}}
    path = planted(tmp_path / "a", put(raw_state(), "config", tagged(sample=record)))
    monkeypatch.setattr("importlib.import_module", no_imports)
    assert read_legacy_checkpoint(path).config == {"sample": {"agent_idx": 1, "returns": [0.5]}}

    # A sample left in a rollout buffer means the save was not at an epoch boundary.
    raw = raw_state()
    buffers = {"__kind__": "list", "items": [{"__kind__": "list", "items": [record]},
                                             {"__kind__": "list", "items": []}]}
    put(get(raw, "runtime"), "rollout_buffers", buffers)
    refused(planted(tmp_path / "b", raw), "'runtime.rollout_buffers'")


def test_owner_file_must_agree_with_the_state(tmp_path):
    path = copy_checkpoint(tmp_path / "a")
    (path / "checkpoint_owner.json").write_text(json.dumps({"run_id": "0" * 32, "sequence": 2}))
    refused(path, "checkpoint_owner.json")
    (path / "checkpoint_owner.json").write_text("{not json")
    refused(path, "checkpoint_owner.json")
    (path / "checkpoint_owner.json").unlink()
    assert "missing" in refused(path, "checkpoint_owner.json")
    # A manual save after a plain train() has no run id and no owner file: that is valid.
    plain = planted(tmp_path / "b", put(raw_state(), "run_id", None))
    (plain / "checkpoint_owner.json").unlink()
    assert read_legacy_checkpoint(plain).run_id is None


def test_wandb_identity_is_read(tmp_path):
    identity = tagged(id="abc123", project="proj", entity="team")
    path = planted(tmp_path, put(raw_state(), "wandb", identity))
    assert read_legacy_checkpoint(path).wandb == {"id": "abc123", "project": "proj", "entity": "team"}

"""rollout_backend="vllm" (comlrl.rollout.vllm) against a stand-in with vLLM 0.33's interface.

vLLM needs CUDA and cannot be installed on the CPU machines the tests run on, so
``tests/fake_vllm`` provides the same names and call protocol (see its README). What is tested here
is comlrl's side: config and trainer checks, engine construction, when weights are pushed (before
the first rollout, after every optimizer step, after a resume), the per-row requests, and how vLLM's
outputs become a Rollout.
"""

from __future__ import annotations

import re
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from comlrl import MAGRPOConfig
from comlrl.exceptions import ConfigError
from comlrl.rollout import SamplingParams
from comlrl.rollout.transformers_loop import TransformersRollout
from helpers import SEED_PROMPTS

FAKE = Path(__file__).parent / "fake_vllm"


def _drop_vllm_modules():
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


@pytest.fixture
def fake_vllm(monkeypatch):
    if importlib.util.find_spec("vllm") is not None and "fake" not in str(importlib.util.find_spec("vllm").origin):
        pytest.skip("a real vLLM is installed; these tests use the stand-in")
    _drop_vllm_modules()
    monkeypatch.syspath_prepend(str(FAKE))
    import comlrl.rollout.vllm as backend
    # The stand-in's engines run on the CPU; the real IPC transfer serves CUDA agents only.
    monkeypatch.setitem(backend.TRANSFER_BACKENDS, "cpu", "ipc")
    import vllm
    vllm.LLM.instances.clear()
    yield vllm
    _drop_vllm_modules()


def _checksum(model):
    return float(sum(p.detach().double().sum() * (i + 1) for i, p in enumerate(model.parameters())))


def test_vllm_backend_without_vllm_is_a_config_error():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    from comlrl._imports import install_hint

    with pytest.raises(ConfigError, match=re.escape(install_hint("vllm"))):
        MAGRPOConfig(rollout_backend="vllm")


def test_vllm_settings_are_checked_when_the_config_is_built(fake_vllm):
    with pytest.raises(ConfigError, match="vllm_gpu_memory_utilization"):
        MAGRPOConfig(rollout_backend="vllm", vllm_gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="JSON"):
        MAGRPOConfig(rollout_backend="vllm", vllm_engine_kwargs={"compilation_config": object()})
    with pytest.raises(ConfigError, match="only apply to rollout_backend='vllm'"):
        MAGRPOConfig(vllm_engine_kwargs={"enforce_eager": True})
    for temperature in (0.005, 2.5):  # vLLM would raise 0.005 to 0.01 silently, and refuse 2.5
        with pytest.raises(ConfigError, match=r"temperatures in \[0.01, 2.0\]"):
            MAGRPOConfig(rollout_backend="vllm", temperature=temperature)
    config = MAGRPOConfig(rollout_backend="vllm", vllm_gpu_memory_utilization=0.2,
                          vllm_engine_kwargs={"enforce_eager": True})
    assert config.to_dict()["vllm_engine_kwargs"] == {"enforce_eager": True}


def test_agents_the_backend_cannot_serve_are_refused(fake_vllm, make_trainer, model_path, monkeypatch, tmp_path):
    import comlrl.rollout.vllm as backend
    monkeypatch.delitem(backend.TRANSFER_BACKENDS, "cpu")
    with pytest.raises(ConfigError, match="CUDA"):
        make_trainer(rollout_backend="vllm")
    peft = pytest.importorskip("peft")
    from comlrl import MAGRPOTrainer
    from helpers import length_ratio_reward
    with pytest.raises(ConfigError, match="LoRA"):
        MAGRPOTrainer(agent_model=model_path, num_agents=2, peft_config=peft.LoraConfig(r=4, target_modules=["q_proj"]),
                      reward_func=length_ratio_reward, train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
                      args=MAGRPOConfig(num_turns=1, rollout_backend="vllm", output_dir=str(tmp_path)))


def test_engines_sample_with_the_live_weights_one_request_per_row(fake_vllm, make_trainer, tokenizer):
    trainer = make_trainer(rollout_backend="vllm", num_train_epochs=1, max_new_tokens=6,
                           trainer_kwargs={"eval_dataset": [{"prompt": "Hello there"}]})
    engines = fake_vllm.LLM.instances
    assert len(engines) == 2
    for engine, agent in zip(engines, trainer.agents):
        assert engine.kwargs["load_format"] == "dummy" and engine.kwargs["dtype"] == "float32"
        assert engine.kwargs["weight_transfer_config"].backend == "ipc"
        assert engine.kwargs["gpu_memory_utilization"] == pytest.approx(0.15)  # 0.3 shared by 2 engines
        assert engine.weight_updates == 0 and _checksum(engine.model) != _checksum(agent)  # dummy weights
    trainer.train()
    # 4 optimizer steps; pushed before each of the 4 rollouts (initial weights, then after steps 1-3).
    assert [e.weight_updates for e in engines] == [4, 4]
    trainer.evaluate()  # the 4th step's weights go out before the next rollout
    assert [e.weight_updates for e in engines] == [5, 5]
    for engine, agent in zip(engines, trainer.agents):
        assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), agent.parameters()))
        assert engine.weights_at_generate[-1] == _checksum(agent)
    prompt, sampling = engines[0].requests[0]
    # Requests carry the prompt's own tokens (no padding): one of the seed prompts, encoded.
    assert prompt["prompt_token_ids"] in [tokenizer(p)["input_ids"] for p in SEED_PROMPTS]
    assert (sampling.n, sampling.temperature, sampling.top_k, sampling.top_p, sampling.max_tokens) == (1, 1.0, 50, 1.0, 6)
    assert sampling.stop_token_ids == [tokenizer.eos_token_id] and sampling.ignore_eos and not sampling.detokenize
    # One request per row, each with its own seed; the two agents use different seeds.
    first_step = [[sp.seed for _, sp in engine.requests[:4]] for engine in engines]
    assert all(len(set(seeds)) == 4 for seeds in first_step) and set(first_step[0]).isdisjoint(first_step[1])
    rows = trainer_metrics(trainer)
    assert len(rows) == 4 and all(1 <= r["train/agent_0/completion_length"] <= 6 for r in rows)


def trainer_metrics(trainer):
    import json
    path = Path(trainer.args.output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resume_pushes_the_checkpoint_weights_before_sampling(fake_vllm, make_trainer, tmp_path):
    eval_set = {"eval_dataset": [{"prompt": "Hello there"}]}
    first = make_trainer(rollout_backend="vllm", num_train_epochs=1, output_dir=str(tmp_path / "a"),
                         trainer_kwargs=eval_set)
    first.train(checkpoint_dir=tmp_path / "ckpt", checkpoint_interval=1)
    saved = [_checksum(a) for a in first.agents]
    fake_vllm.LLM.instances.clear()
    second = make_trainer(rollout_backend="vllm", num_train_epochs=2, output_dir=str(tmp_path / "b"),
                          trainer_kwargs=eval_set)
    second.evaluate()  # the engines now hold the initial weights
    engines = fake_vllm.LLM.instances
    assert [e.weights_at_generate[-1] for e in engines] == [_checksum(a) for a in second.agents] != saved
    calls = [len(e.weights_at_generate) for e in engines]
    second.train(resume_from_checkpoint=tmp_path / "ckpt" / "checkpoint-1")
    assert [e.weights_at_generate[c] for e, c in zip(engines, calls)] == saved


def test_outputs_become_a_rollout_padded_after_the_end_of_sequence(fake_vllm, model_path, tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    from comlrl.rollout.vllm import VLLMRollout
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    scripted = iter([[7, 8, eos], [9, 10, 11, 12], [13, eos], [14, 15, 16, 17]])
    monkeypatch.setattr(fake_vllm.LLM, "_sample",
                        lambda self, ids, sp: fake_vllm.CompletionOutput(0, "", next(scripted), "stop"))
    models = [AutoModelForCausalLM.from_pretrained(model_path)]
    backend = VLLMRollout(models, [tokenizer])
    params = SamplingParams(max_new_tokens=4, top_k=50)
    (ro,) = backend.sample([["Hello", "Write a story"]], [[[1, 2], [3, 4]]], params, [[eos]], [True])
    assert ro.completion_ids.tolist() == [[7, 8, eos, pad], [9, 10, 11, 12], [13, eos, pad, pad], [14, 15, 16, 17]]
    assert ro.completion_mask.tolist() == [[True] * 3 + [False], [True] * 4, [True] * 2 + [False] * 2, [True] * 4]
    assert ro.group_ids.tolist() == [0, 0, 1, 1]
    assert [sp.seed for _, sp in fake_vllm.LLM.instances[0].requests] == [1, 2, 3, 4]
    # The same prompts and seeds give the transformers backend the same prompt tensors.
    (reference,) = TransformersRollout(models, [tokenizer]).sample([["Hello", "Write a story"]], [[[1, 2], [3, 4]]],
                                                                   params, [[eos]], [True])
    assert torch.equal(ro.prompt_ids, reference.prompt_ids) and torch.equal(ro.prompt_mask, reference.prompt_mask)
    # An engine that stops early without an end-of-sequence token is an error, not a silent row.
    scripted = iter([[7, 8]] * 4)
    with pytest.raises(RuntimeError, match="end-of-sequence"):
        backend.sample([["Hello", "Write a story"]], [[[1, 2], [3, 4]]], params, [[eos]], [True])


def test_engine_setup_a_real_vllm_needs(fake_vllm, model_path, tokenizer, monkeypatch):
    """What vLLM 0.33 requires beyond the API shape: pickled IPC handles allowed, a transfer buffer
    that holds the largest weight, a config naming its architecture, a prefix cache that really
    was cleared."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import comlrl.rollout.vllm as backend
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    monkeypatch.setattr(backend, "MIN_TRANSFER_BUFFER_BYTES", 1024)
    config = AutoConfig.from_pretrained(model_path)
    config.architectures = None  # a model built from a config, never saved
    model = AutoModelForCausalLM.from_config(config)
    engine = backend.VLLMRollout([model], [tokenizer])
    import os
    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert engine.senders[0].init_info.packed_buffer_size_bytes == largest > 1024
    params = SamplingParams(max_new_tokens=3, top_k=50)
    engine.sample([["Hello"]], [[[1, 2]]], params, [[tokenizer.eos_token_id]], [True])  # pushes, then samples
    assert fake_vllm.LLM.instances[0].weight_updates == 1
    engine.mark_stale()
    fake_vllm.LLM.instances[0].blocks_in_use = True
    with pytest.raises(RuntimeError, match="prefix cache"):
        engine.sample([["Hello"]], [[[1, 2]]], params, [[tokenizer.eos_token_id]], [True])
    folder = Path(engine._dirs[0].name)
    assert (folder / "config.json").exists()
    engine.close()  # stops the engine process and removes the config folder
    assert fake_vllm.LLM.instances[0].shut_down and not folder.exists() and engine.engines == []

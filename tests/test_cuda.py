"""What only a CUDA machine can check; every test here is skipped without CUDA ("no CUDA").

``scripts/gpu_check.sh`` runs this file on a GPU machine and reports it by group, by test-name
prefix (the CPU suite tests the same code paths with CPU stand-ins):

* ``test_bf16_*``: ``mixed_precision="bf16"`` training on a GPU, and bf16 weights;
* ``test_agent_devices_*``: agents placed on GPUs (one GPU, two GPUs sampling concurrently, GPU +
  CPU), checkpoints written on CUDA resumed on CUDA and on the CPU;
* ``test_torchrun_*``: ``torchrun`` on GPUs; 2 processes over NCCL need 2 GPUs (NCCL runs one rank
  per GPU), against one process;
* ``test_lean_decoder_*``: the lean decoder (``comlrl.rollout.lean``) against transformers' forward
  on CUDA: step logits, sampled tokens, stacked agents, bf16;
* ``test_vllm_*``: ``rollout_backend="vllm"`` with the real vLLM package (``pip install
  'comlrl[vllm]'``) on a tiny model: the engine samples with the weights pushed to it, and a run trains.

GPU arithmetic is not bit-reproducible the way the CPU's is (atomic adds in backward kernels), so
runs are compared within tolerances here; the CPU suite keeps the bit-exact checks.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import SEED_PROMPTS, length_ratio_reward, rows, state_of

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]

WORKER = Path(__file__).with_name("dist_worker.py")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_two_gpus = pytest.mark.skipif(0 < GPUS < 2, reason=f"needs 2 CUDA devices, this machine has {GPUS}")


def assert_states_close(a: dict, b: dict, rtol: float = 1e-3, atol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            torch.testing.assert_close(a[key].float().cpu(), b[key].float().cpu(), rtol=rtol, atol=atol, msg=key)


def assert_rows_close(a: list[dict], b: list[dict]) -> None:
    assert [r["env_step"] for r in a] == [r["env_step"] for r in b]
    for x, y in zip(a, b):
        assert x["train/reward_mean"] == pytest.approx(y["train/reward_mean"], abs=1e-6)


def agent_devices_of(trainer) -> list[str]:
    return [str(next(agent.parameters()).device) for agent in trainer.agents]


# ------------------------------------------------------------------------------------------------
# bf16
# ------------------------------------------------------------------------------------------------

def test_bf16_autocast_training_on_cuda(make_trainer, tmp_path):
    runs = []
    for name in ("a", "b"):
        trainer = make_trainer(num_train_epochs=1, agent_devices="cuda", mixed_precision="bf16",
                               output_dir=str(tmp_path / name))
        before = state_of(trainer)
        trainer.train()
        logged = rows(tmp_path / name)
        assert logged and all(math.isfinite(r["agent_0/loss"]) and math.isfinite(r["agent_0/grad_norm"])
                              for r in logged)
        after = state_of(trainer)
        assert any(not torch.equal(before[k], after[k]) for k in before if ".param." in k)
        assert all(p.dtype == torch.float32 and p.is_cuda for p in trainer.agents[0].parameters())
        runs.append((logged, after))
    # The same seed: the first step samples the same tokens; the rest agrees within GPU tolerance.
    assert runs[0][0][0]["train/reward_mean"] == runs[1][0][0]["train/reward_mean"]
    assert_states_close(runs[0][1], runs[1][1])


def test_bf16_weights_train_on_cuda(model_path, tokenizer, tmp_path):
    """Agents loaded in bfloat16 (weights, gradients and AdamW state in bf16), as the GPU throughput
    benchmark runs every framework."""
    from transformers import AutoModelForCausalLM

    from comlrl import MAGRPOConfig, MAGRPOTrainer
    from helpers import TEST_SETTINGS

    trainer = MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16) for _ in range(2)],
        tokenizer=tokenizer, reward_func=length_ratio_reward, train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
        args=MAGRPOConfig(**{**TEST_SETTINGS, "num_train_epochs": 1, "max_new_tokens": 16, "agent_learning_rate": 1e-3,
                             "agent_devices": "cuda", "output_dir": str(tmp_path)}))
    trainer.train(checkpoint_dir=tmp_path / "ckpt")
    logged = rows(tmp_path / "ckpt")
    assert len(logged) == 4 and all(math.isfinite(r["agent_1/loss"]) for r in logged)
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in trainer.agents[1].parameters())


# ------------------------------------------------------------------------------------------------
# agent_devices
# ------------------------------------------------------------------------------------------------

def test_agent_devices_one_gpu_checkpoint_and_resume(make_trainer, tmp_path):
    whole = make_trainer(num_train_epochs=2, agent_devices="cuda", output_dir=str(tmp_path / "whole"))
    assert agent_devices_of(whole) == ["cuda:0", "cuda:0"]
    whole.train(checkpoint_dir=tmp_path / "whole", checkpoint_interval=1)

    first = make_trainer(num_train_epochs=1, agent_devices="cuda:0", output_dir=str(tmp_path / "resumed"))
    first.train(checkpoint_dir=tmp_path / "resumed", checkpoint_interval=1)
    resumed = make_trainer(num_train_epochs=2, agent_devices="cuda:0", output_dir=str(tmp_path / "resumed"))
    resumed.train(resume_from_checkpoint=tmp_path / "resumed" / "checkpoint-1", checkpoint_dir=tmp_path / "resumed",
                  checkpoint_interval=1)
    assert_rows_close(rows(tmp_path / "whole"), rows(tmp_path / "resumed"))
    assert_states_close(state_of(whole), state_of(resumed))

    # Devices may change on resume: the CUDA checkpoint continues on the CPU.
    on_cpu = make_trainer(num_train_epochs=3, agent_devices="cpu", output_dir=str(tmp_path / "resumed"))
    on_cpu.train(resume_from_checkpoint=tmp_path / "resumed" / "checkpoint-2", checkpoint_dir=tmp_path / "resumed")
    assert agent_devices_of(on_cpu) == ["cpu", "cpu"]
    assert [r["env_step"] for r in rows(tmp_path / "resumed")][-1] == 48


def test_agent_devices_gpu_and_cpu(make_trainer, tmp_path):
    trainer = make_trainer(num_train_epochs=1, agent_devices=["cuda:0", "cpu"])
    assert agent_devices_of(trainer) == ["cuda:0", "cpu"]
    trainer.train(checkpoint_dir=tmp_path / "ckpt")
    assert len(rows(tmp_path / "ckpt")) == 4
    assert agent_devices_of(trainer) == ["cuda:0", "cpu"]


@needs_two_gpus
def test_agent_devices_two_gpus_sample_concurrently(make_trainer, tmp_path):
    """One agent per GPU (rollouts run concurrently, one thread per GPU) samples and learns what both
    agents on one GPU do."""
    spread = make_trainer(num_train_epochs=1, agent_devices=["cuda:0", "cuda:1"], output_dir=str(tmp_path / "two"))
    assert agent_devices_of(spread) == ["cuda:0", "cuda:1"]
    spread.train()
    together = make_trainer(num_train_epochs=1, agent_devices="cuda:0", output_dir=str(tmp_path / "one"))
    together.train()
    assert_rows_close(rows(tmp_path / "one"), rows(tmp_path / "two"))
    assert_states_close(state_of(together), state_of(spread))


# ------------------------------------------------------------------------------------------------
# torchrun
# ------------------------------------------------------------------------------------------------

def run_worker(run_dir: Path, *args: str, procs: int = 0) -> subprocess.CompletedProcess:
    """tests/dist_worker.py alone (procs=0) or under torchrun with ``procs`` processes."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] \
        if procs else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COMLRL_DISABLE_PROGRESS": "1"}
    env.pop("WORLD_SIZE", None)
    result = subprocess.run(launcher + [str(WORKER), str(run_dir), *args], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def test_torchrun_one_process_places_agents_on_its_gpu(tmp_path):
    run_worker(tmp_path / "run", "--devices", "auto", procs=1)
    placed = json.loads((tmp_path / "run" / "device-rank0.json").read_text())
    assert placed["device"] == "cuda:0"


@needs_two_gpus
def test_torchrun_nccl_two_gpus_match_one_process(tmp_path):
    from safetensors.torch import load_file

    run_worker(tmp_path / "one", "--devices", "cuda:0")
    run_worker(tmp_path / "two", "--devices", "auto", procs=2)
    placed = [json.loads((tmp_path / "two" / f"device-rank{r}.json").read_text()) for r in (0, 1)]
    assert placed == [{"device": "cuda:0", "backend": "nccl"}, {"device": "cuda:1", "backend": "nccl"}]
    one = load_file(str(tmp_path / "one" / "final-rank0.safetensors"))
    ranks = [load_file(str(tmp_path / "two" / f"final-rank{r}.safetensors")) for r in (0, 1)]
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])  # the same AdamW step on every rank
    for key in one:
        torch.testing.assert_close(ranks[0][key], one[key], rtol=1e-3, atol=1e-4, msg=key)
    assert_rows_close(rows(tmp_path / "one" / "ckpt"), rows(tmp_path / "two" / "ckpt"))


@needs_two_gpus
def test_fsdp2_over_nccl_matches_one_unsharded_process(tmp_path):
    """sharding="fsdp2" on 2 GPUs (NCCL): the run of one unsharded GPU process within float
    tolerance, each GPU holding half of each agent, and the checkpoint resumes on one process."""
    from safetensors.torch import load_file

    run_worker(tmp_path / "one", "--devices", "cuda:0")
    run_worker(tmp_path / "two", "--devices", "auto", "--sharding", "fsdp2", procs=2)
    record = json.loads((tmp_path / "two" / "rank0.json").read_text())
    assert all(0.4 <= f <= 0.6 for f in record["params_fraction"] + record["moments_fraction"])
    one = load_file(str(tmp_path / "one" / "final-rank0.safetensors"))
    two = load_file(str(tmp_path / "two" / "final-rank0.safetensors"))
    for key in (k for k in one if ".opt." not in k):
        torch.testing.assert_close(two[key], one[key], rtol=1e-3, atol=1e-4, msg=key)
    assert_rows_close(rows(tmp_path / "one" / "ckpt"), rows(tmp_path / "two" / "ckpt"))
    run_worker(tmp_path / "two", "--devices", "cuda:0", "--epochs", "3", "--resume",
               str(tmp_path / "two" / "ckpt" / "checkpoint-2"))


# ------------------------------------------------------------------------------------------------
# the lean decoder on CUDA (tests/test_fast_decode.py holds the CPU versions)
# ------------------------------------------------------------------------------------------------

LEAN_MODELS = ["qwen2-gqa", "qwen2-mqa", "llama-bias", "tiny-qwen2"]


def lean_model(name: str, dtype=torch.float32):
    from test_fast_decode import MODELS

    return MODELS[name]().to(device="cuda", dtype=dtype)


def lean_and_reference_logits(model, steps: int = 12):
    """Logits of ``steps`` one-token steps through transformers and through the lean StaticDecoder."""
    from test_fast_decode import reference_and_fast_logits

    return reference_and_fast_logits(model, steps, device="cuda")


def lean_sample(model, backend: str, seeds=(1, 2, 3, 4)) -> torch.Tensor:
    from comlrl.rollout import SamplingParams, left_pad, row_uniforms
    from comlrl.rollout.transformers_loop import generate
    from test_fast_decode import PROMPTS

    ids, mask = (t.cuda() for t in left_pad(PROMPTS, 0))
    return generate(model, ids, mask, row_uniforms(list(seeds), 40), SamplingParams(40, 1.0, 0.9, 50), [0], 0,
                    backend=backend)


@pytest.mark.parametrize("name", LEAN_MODELS)
def test_lean_decoder_steps_equal_transformers_steps_on_cuda(name):
    from comlrl.rollout import lean

    model = lean_model(name)
    assert lean.supports_static_decoding(model) is None
    ref, got = lean_and_reference_logits(model)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", LEAN_MODELS)
def test_lean_decoder_sampled_tokens_equal_transformers_on_cuda(name):
    from comlrl.rollout import lean

    model = lean_model(name)
    lean._VERIFIED.pop(model, None)
    fast = lean_sample(model, "auto")
    assert lean._VERIFIED.get(model) is True, "the lean decoder failed its check against transformers on CUDA"
    hf = lean_sample(model, "hf")
    assert fast.is_cuda and torch.equal(fast, hf)


def test_lean_decoder_bf16_steps_stay_close_on_cuda():
    ref, got = lean_and_reference_logits(lean_model("qwen2-gqa", dtype=torch.bfloat16))
    assert float((got.float() - ref.float()).abs().max()) < 0.05 * (1 + float(ref.float().abs().max()))


def test_lean_decoder_stacked_agents_equal_each_agent_alone_on_cuda():
    from comlrl.rollout import SamplingParams, lean
    from comlrl.rollout.transformers_loop import rollout, rollout_agents
    from test_fast_decode import AGENT_PROMPTS, AGENT_SEEDS, two_agents

    models, tok = two_agents()
    models = [m.cuda() for m in models]
    assert lean.stackable(models)
    params = SamplingParams(48, 1.0, 0.9, 50)
    eos = [[0], [0, 7, 9]]
    together = rollout_agents(models, [tok, tok], AGENT_PROMPTS, AGENT_SEEDS, params, eos, [True, True])
    alone = [rollout(m, tok, p, s, params, e) for m, p, s, e in zip(models, AGENT_PROMPTS, AGENT_SEEDS, eos)]
    for x, y in zip(together, alone):
        assert x.completion_ids.is_cuda
        assert torch.equal(x.completion_ids, y.completion_ids) and x.texts == y.texts


# ------------------------------------------------------------------------------------------------
# vLLM (the real package; tests/test_vllm_backend.py tests comlrl's side against a stand-in)
# ------------------------------------------------------------------------------------------------

# head_dim 64: a size every vLLM attention backend serves (the tiny models' 16 is not).
VLLM_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=False)


@pytest.fixture
def real_vllm():
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed (pip install 'comlrl[vllm]')")
    if "fake_vllm" in str(spec.origin):
        pytest.skip("only the stand-in tests/fake_vllm is importable")
    import vllm

    return vllm


def always_emit(model, token: int) -> None:
    """Make ``model`` (Qwen2, untied head) put all its probability on ``token`` whatever the input:
    the layers add nothing to the residual stream (zero output projections), every embedding has a
    large first coordinate, the final norm keeps only that coordinate, and the head reads it into
    ``token``'s logit alone."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[token, 0] = 50.0


def test_vllm_engine_samples_with_the_weights_pushed_to_it(real_vllm):
    """The engine starts from random weights; every rollout must sample from the agent's weights as
    they are now, including after they change."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.rollout import SamplingParams
    from comlrl.rollout.vllm import VLLMRollout
    from comlrl.testing import qwen2_model_dir

    path = qwen2_model_dir(VLLM_SHAPE)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    first, second = 17, 42  # neither is the end-of-sequence id (0)
    always_emit(model, first)
    backend = VLLMRollout([model], [tokenizer], seed=0, engine_kwargs={"enforce_eager": True, "max_model_len": 256})
    try:
        params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=50)
        prompts, seeds = [SEED_PROMPTS[:2]], [[[1, 2], [3, 4]]]
        (out,) = backend.sample(prompts, seeds, params, [[tokenizer.eos_token_id]], [True])
        assert out.completion_ids.shape == (4, 12) and bool((out.completion_ids == first).all())
        always_emit(model, second)
        backend.mark_stale()
        (out,) = backend.sample(prompts, seeds, params, [[tokenizer.eos_token_id]], [True])
        assert bool((out.completion_ids == second).all()), "the engine sampled from weights older than the agent's"
        assert backend.weight_syncs == [2]
    finally:
        backend.close()


def test_vllm_backend_trains_on_cuda(real_vllm, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl import MAGRPOConfig, MAGRPOTrainer
    from comlrl.testing import qwen2_model_dir
    from helpers import TEST_SETTINGS

    path = qwen2_model_dir(VLLM_SHAPE)
    trainer = MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(path) for _ in range(2)],
        tokenizer=AutoTokenizer.from_pretrained(path), reward_func=length_ratio_reward,
        train_dataset=[{"prompt": p} for p in SEED_PROMPTS],
        args=MAGRPOConfig(**{**TEST_SETTINGS, "num_train_epochs": 1, "max_new_tokens": 16, "agent_learning_rate": 1e-3,
                             "agent_devices": "cuda", "mixed_precision": "bf16", "rollout_backend": "vllm",
                             "vllm_engine_kwargs": {"enforce_eager": True, "max_model_len": 256},
                             "output_dir": str(tmp_path)}))
    try:
        trainer.train(checkpoint_dir=tmp_path / "ckpt")
        logged = rows(tmp_path / "ckpt")
        assert len(logged) == 4 and all(math.isfinite(r["agent_0/loss"]) for r in logged)
        assert all(1 <= r["train/agent_1/completion_length"] <= 16 for r in logged)
        assert trainer.backend.weight_syncs == [4, 4]  # before each of the 4 rollouts
    finally:
        trainer.close()

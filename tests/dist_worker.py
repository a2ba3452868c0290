"""Run by test_distributed.py, test_sharding.py and test_cuda.py, alone (`python dist_worker.py ...`)
or under `torchrun`.

One run: ``dist_worker.py RUN_DIR [options]`` trains the seed task on the tiny model (optionally
resuming), then writes each rank's agent weights and optimizer moments to
``<run>/final-rank<r>.safetensors``, the gradients of each optimizer step to
``<run>/grads-rank<r>.safetensors`` and what the rank saw to ``<run>/rank<r>.json``.

Several runs, one after another in the same processes (one import of torch and transformers, one
process group): ``dist_worker.py --batch SPECS.json``, a list of ``{"args": [RUN_DIR, options...]}``
(``"expect_error": true``: the run must be refused; its message is kept), and ``{"copy": [SRC, DST]}``
(rank 0 copies a run folder, the others wait). Each rank leaves ``<run>/done-rank<r>`` when a run
finished and writes the run's comlrl log lines to ``<run>/log-rank<r>.txt``; a run that fails writes
``<run>/error-rank<r>.txt`` and ends the batch (torchrun then stops the other processes).
"""

import argparse
import json
import logging
import os
import shutil
import sys
import traceback
from pathlib import Path

os.environ.setdefault("COMLRL_DISABLE_PROGRESS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from comlrl import MAGRPOConfig, MAGRPOTrainer  # noqa: E402
from comlrl.testing import tiny_model_dir  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from helpers import SEED_PROMPTS, TEST_SETTINGS, length_ratio_reward  # noqa: E402

torch.set_num_threads(1)
parser = argparse.ArgumentParser()
parser.add_argument("run_dir", type=Path)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--resume", default=None)
parser.add_argument("--train-batch-size", type=int, default=4)
parser.add_argument("--micro-batches", type=int, default=1, help="forward/backward passes per optimizer step")
parser.add_argument("--num-turns", type=int, default=1)
parser.add_argument("--loss-type", default="grpo")
parser.add_argument("--extra-prompt", action="store_true", help="5 prompts: the last micro-batch is uneven")
parser.add_argument("--eval", action="store_true")
parser.add_argument("--lora", action="store_true", help="LoRA agents on one shared base")
parser.add_argument("--family", default="magrpo", choices=["magrpo", "iac", "iac-shared", "maac", "madpo", "marlhf"])
parser.add_argument("--devices", default="cpu", help="agent_devices; 'auto': under torchrun on GPUs, cuda:LOCAL_RANK")
parser.add_argument("--sharding", default="none", choices=["none", "fsdp2"])
parser.add_argument("--ppo", action="store_true", help="clipped-ratio update, 2 passes over 2-step buffers")
parser.add_argument("--kl", type=float, default=None, help="reference KL coefficient (MAGRPO)")
parser.add_argument("--mixed-precision", default=None, choices=["bf16"])


def refine(agent_completions, prompt_history_per_agent, **_):
    return [f"{h[0]} Draft: {c[:20]} Again:" for h, c in zip(prompt_history_per_agent, agent_completions)]


def train_run(opts: argparse.Namespace) -> None:
    prompts = SEED_PROMPTS + (["Name a color:"] if opts.extra_prompt else [])
    multi_turn = opts.num_turns > 1
    path = tiny_model_dir()
    if opts.lora:
        from peft import LoraConfig

        models = dict(agent_model=str(path), num_agents=2,
                      peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    else:
        models = dict(agents=[AutoModelForCausalLM.from_pretrained(path) for _ in range(2)])
    settings = {**TEST_SETTINGS, "num_train_epochs": opts.epochs, "max_new_tokens": 10, "agent_learning_rate": 1e-3,
                "output_dir": str(opts.run_dir / "out"), "agent_devices": None if opts.devices == "auto" else opts.devices,
                "rollout_buffer_size": opts.train_batch_size,
                "micro_batch_size": opts.train_batch_size // opts.micro_batches if opts.micro_batches > 1 else None,
                "num_turns": opts.num_turns, "early_termination_threshold": 0.5 if multi_turn else None,
                "loss_type": opts.loss_type, "eval_interval": 1 if opts.eval else 0, "sharding": opts.sharding,
                "mixed_precision": opts.mixed_precision}
    if opts.ppo:
        settings.update(ppo_clip_eps=0.2, num_update_epochs=2, rollout_buffer_size=2 * opts.train_batch_size)
    if opts.kl is not None:
        settings.update(reference_kl_enabled=True, reference_kl_coef=opts.kl)
    common = dict(tokenizer=AutoTokenizer.from_pretrained(path), reward_func=length_ratio_reward,
                  train_dataset=[{"prompt": p} for p in prompts],
                  eval_dataset=[{"prompt": p} for p in prompts] if opts.eval else None,
                  external_transition=refine if multi_turn else None)
    if opts.family == "magrpo":
        trainer = MAGRPOTrainer(**models, **common, args=MAGRPOConfig(**settings))
    elif opts.family in ("madpo", "marlhf"):
        from comlrl.trainers.preference import MADPOConfig, MADPOTrainer, MARLHFConfig, MARLHFTrainer

        # Preference: the pairs are sampled on both processes' shares and gathered; a DPO / reward-model /
        # online step splits its pairs or prompts over the processes.
        pref = {k_: v for k_, v in settings.items() if k_ not in ("loss_type", "num_generations", "num_turns",
                                                                 "early_termination_threshold")}
        pref.update(preference_num_candidates=4, preference_pairs_per_sample=2, train_batch_size=4)
        if opts.family == "madpo":
            trainer = MADPOTrainer(**models, **common, args=MADPOConfig(**pref))
        else:
            trainer = MARLHFTrainer(**models, **common, args=MARLHFConfig(
                **pref, reward_model_device="cpu", num_generations=2, reward_train_batch_size=4,
                reward_learning_rate=1e-3), reward_model=str(path))
    else:
        from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer

        # Actor-critic: buffers and steps count samples (K per prompt); K = 1 for several turns.
        k = 1 if multi_turn else 2
        ac = {k_: v for k_, v in settings.items() if k_ != "loss_type"}
        ac.update(num_generations=k, rollout_buffer_size=opts.train_batch_size * k, critic_learning_rate=1e-3,
                  reference_kl_enabled=True, reference_kl_coef=0.05)
        critic = {} if opts.family == "iac-shared" or opts.lora else {"critic_model": str(path)}
        if opts.family == "maac":
            trainer = MAACTrainer(**models, **critic, **common, args=MAACConfig(**ac))
        else:
            trainer = IACTrainer(**models, **critic, **common,
                                 args=IACConfig(use_separate_critic=opts.family != "iac-shared", **ac))
    from helpers import record_gradients

    recorded = record_gradients(trainer)  # what each optimizer step applies (summed over processes)
    # --mixed-precision: the dtype each agent's first projection has inside its forwards (FSDP2 swaps in
    # the gathered parameters, cast by its MixedPrecisionPolicy, for the forward). Only then: a hook
    # keeps the rollout off the lean decoder.
    forward_dtypes: dict[str, set] = {}
    for a, agent in enumerate(trainer.agents if opts.mixed_precision else []):
        if hasattr(agent, "model") and hasattr(agent.model, "layers"):
            projection = agent.model.layers[0].self_attn.q_proj
            projection.register_forward_pre_hook(
                lambda m, args, a=a: forward_dtypes.setdefault(str(a), set()).add(str(m.weight.dtype)))
    trainer.train(resume_from_checkpoint=opts.resume, checkpoint_dir=opts.run_dir / "ckpt")
    first_step = trainer.state.global_step - len(recorded) + 1
    trainer.save_model(opts.run_dir / "saved")
    slots = trainer.trained_slots()
    if trainer.sharded:  # whole tensors from every process's shards
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        tensors = {}
        for s, m in slots.modules.items():
            named = {n for n, _ in m.named_parameters()}
            tensors.update({f"{s}.{n}": v.contiguous() for n, v in get_model_state_dict(m, options=whole).items()
                            if n in named})
            for fqn, st in get_optimizer_state_dict(m, slots.optimizers[s], options=whole).get("state", {}).items():
                tensors.update({f"{s}.opt.{fqn}.{k}": v.reshape(-1).contiguous() for k, v in st.items()})
    else:
        tensors = {f"{s}.{n}": p.detach().cpu().contiguous() for s, m in slots.modules.items()
                   for n, p in m.named_parameters()}
        for s, opt in slots.optimizers.items():
            for idx, st in opt.state_dict()["state"].items():
                for k, v in st.items():
                    tensors[f"{s}.opt.{idx}.{k}"] = v.detach().reshape(-1).cpu().contiguous()
    rank = trainer.dist.rank
    save_file(tensors, str(opts.run_dir / f"final-rank{rank}.safetensors"))
    save_file({f"{first_step + i}/{k}": v.contiguous() for i, step in enumerate(recorded) for k, v in step.items()},
              str(opts.run_dir / f"grads-rank{rank}.safetensors"))
    record = {"world_size": trainer.dist.world_size, "env_step": trainer.state.env_step,
              "forward_dtypes": {a: sorted(d) for a, d in forward_dtypes.items()},
              "master_dtypes": sorted({str(p.dtype) for m in trainer.agents for p in m.parameters()})}
    if trainer.sharded:  # what this process holds of each agent and its AdamW moments
        from comlrl.engine.sharding import local_fraction

        record["params_fraction"] = [local_fraction(list(m.parameters())) for m in trainer.agents]
        record["moments_fraction"] = [local_fraction([v for st in o.state.values() for k, v in st.items()
                                                      if k.startswith("exp_avg")]) for o in trainer.optimizers]
    if opts.lora:
        from comlrl.adapters import base_fingerprint

        record["base"] = base_fingerprint(trainer.agents[0].shared)["content"]
    (opts.run_dir / f"rank{rank}.json").write_text(json.dumps(record))
    if opts.devices != "cpu":  # tests/test_cuda.py: where the agents trained and over which backend
        import torch.distributed as torch_dist

        (opts.run_dir / f"device-rank{rank}.json").write_text(json.dumps({
            "device": str(next(trainer.agents[0].parameters()).device),
            "backend": torch_dist.get_backend() if torch_dist.is_initialized() else None}))


def barrier() -> None:
    import torch.distributed as torch_dist

    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.barrier()


def run_batch(specs: list[dict]) -> None:
    from comlrl.engine.distributed import init_distributed

    rank = init_distributed(use_cuda=False).rank  # the group every run of the batch joins
    for spec in specs:
        if "copy" in spec:
            if rank == 0:
                # What the source's processes left (done, log and error files) stays behind.
                shutil.copytree(*spec["copy"], ignore=shutil.ignore_patterns("done-rank*", "log-rank*", "error-rank*"))
            barrier()
            continue
        opts = parser.parse_args(spec["args"])
        opts.run_dir.mkdir(parents=True, exist_ok=True)
        log = logging.FileHandler(opts.run_dir / f"log-rank{rank}.txt")
        logging.getLogger("comlrl").addHandler(log)
        try:
            train_run(opts)
        except Exception as exc:
            (opts.run_dir / f"error-rank{rank}.txt").write_text(
                "".join(traceback.format_exception(exc)) if not spec.get("expect_error") else str(exc))
            if not spec.get("expect_error"):
                raise
        finally:
            logging.getLogger("comlrl").removeHandler(log)
            log.close()
        (opts.run_dir / f"done-rank{rank}").touch()
        barrier()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--batch"]:
        run_batch(json.loads(Path(sys.argv[2]).read_text()))
    else:
        train_run(parser.parse_args())

"""The seed workload on the public ``comlrl==1.4.3`` MAGRPOTrainer (a peer of benchmarks/throughput.py).

    /tmp/venv-comlrl143/bin/python benchmarks/peers/comlrl143_seed.py --model-dir DIR [--epochs 3] ...

Runs in its own virtual environment (see benchmarks/README.md). Two agents, 1 turn, K completions
per prompt, one optimizer step per prompt and agent (rollout_buffer_size = train_batch_size = 1),
the seed's length-ratio reward, on ``--device`` (default the CPU): ``agent_devices`` is the package's
own device setting, nothing is patched; the models are loaded in ``--dtype``. Prints one JSON line:
seconds_per_epoch, env_steps_per_s, peak_rss_mb, peak_gpu_mb.
"""

import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import clock, emit, model_dtype, parser, peak_gpu_mb, peak_rss_mb, reward, setup  # noqa: E402


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    now = clock(args.clock)
    prompts = setup(args)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import comlrl

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    common = dict(num_train_epochs=args.epochs, agent_learning_rate=args.lr, num_agents=2, agent_devices=args.device,
                  num_generations=args.num_generations, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, num_turns=1, eval_interval=0,
                  advantage_normalization=args.advantage_normalization, logging_steps=1)
    built_start = now()
    agents = [AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=model_dtype(args)) for _ in range(2)]
    dataset = Dataset.from_dict({"prompt": prompts})
    if args.trainer in ("madpo", "marlhf"):
        # Preference: K candidates per prompt, 4 pairs per prompt, 4 pairs per DPO step; MARLHF: a reward
        # model (the same model) on the pairs for one epoch, then MAGRPO epochs with it, one prompt per step.
        from comlrl.trainers.preference import MADPOConfig, MADPOTrainer, MARLHFConfig, MARLHFTrainer

        pref = {k: v for k, v in common.items() if k not in ("num_generations", "advantage_normalization")}
        pref.update(preference_num_candidates=args.num_generations, preference_pairs_per_sample=4)
        if args.trainer == "madpo":
            trainer = MADPOTrainer(agents=agents, tokenizer=tokenizer, reward_func=reward, train_dataset=dataset,
                                   args=MADPOConfig(**pref, train_batch_size=4))
        else:
            trainer = MARLHFTrainer(agents=agents, tokenizer=tokenizer, reward_func=reward, train_dataset=dataset,
                                    args=MARLHFConfig(**pref, rl_algorithm="magrpo",
                                                      num_generations=args.num_generations, rollout_buffer_size=1,
                                                      train_batch_size=1, advantage_normalization=False,
                                                      reward_model_name=args.model_dir,
                                                      reward_model_device=args.device, reward_train_batch_size=4,
                                                      reward_learning_rate=args.lr))
    elif args.trainer == "magrpo":
        from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

        config = MAGRPOConfig(**common, rollout_buffer_size=args.rollout_buffer_size,
                              train_batch_size=args.train_batch_size or args.rollout_buffer_size, advantage_mode="mean")
        trainer = MAGRPOTrainer(agents=agents, tokenizer=tokenizer, reward_func=reward, args=config,
                                train_dataset=dataset)
    else:
        # Actor-critic: buffers count samples, so K samples = one prompt per optimizer step.
        from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer

        k = args.num_generations
        sizes = dict(rollout_buffer_size=k, train_batch_size=k, critic_learning_rate=args.lr,
                     critic_devices=args.device)
        if args.trainer == "iac":
            trainer = IACTrainer(agents=agents, critic_model=args.model_dir, tokenizer=tokenizer, reward_func=reward,
                                 args=IACConfig(**common, **sizes), train_dataset=dataset)
        else:
            trainer = MAACTrainer(agents=agents, critic_model=args.model_dir, tokenizer=tokenizer,
                                  reward_func=reward, args=MAACConfig(**common, **sizes), train_dataset=dataset)
    assert all(p.device.type == args.device.split(":")[0] for m in trainer.agents for p in m.parameters())
    built_s = now() - built_start
    with tempfile.TemporaryDirectory() as tmp:
        start = now()
        if args.checkpoint:
            trainer.train(checkpoint_dir=os.path.join(tmp, "ckpt"), checkpoint_interval=1)
        else:
            trainer.train()
        elapsed = now() - start
        saved = sorted(p.name for p in Path(tmp, "ckpt").glob("*")) if args.checkpoint else []
    emit({
        "framework": f"comlrl {getattr(comlrl, '__version__', '1.4.3')}",
        "epochs": args.epochs, "elapsed_s": elapsed,
        "seconds_per_epoch": elapsed / args.epochs,
        "env_steps": trainer.env_step, "env_steps_per_s": trainer.env_step / elapsed,
        "generated_tokens_per_s": None,  # not exposed by its API
        "peak_rss_mb": peak_rss_mb(), "peak_gpu_mb": peak_gpu_mb(), "checkpoint_dir_entries": saved,
        "device": args.device, "dtype": args.dtype, "construction_s": built_s, "clock": args.clock,
    })


if __name__ == "__main__":
    main()

"""Plain helpers shared by the tests (importable: the tests folder is on sys.path)."""

from comlrl.testing import SEED_PROMPTS, length_ratio_reward

__all__ = ["SEED_PROMPTS", "TEST_SETTINGS", "length_ratio_reward", "state_of", "assert_bit_exact", "rows", "play"]

# What most tests train with, set explicitly rather than relying on the (CoMLRL 1.4.3) defaults:
# one turn, one prompt per optimizer step, plain sampling, the GRPO token-mean loss.
TEST_SETTINGS = dict(num_turns=1, num_generations=4, logging_steps=1, eval_interval=0, rollout_buffer_size=1,
                     temperature=1.0, top_p=1.0, top_k=50, loss_type="grpo", advantage_normalization=False,
                     weight_decay=0.0, max_grad_norm=1.0, shuffle=True, early_termination_threshold=None)


def state_of(trainer):
    """Every parameter and optimizer tensor of every trained module, by name."""
    import torch

    out = {}
    slots = trainer._slots()
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

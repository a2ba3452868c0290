"""Tiny models and tokenizers built offline, for tests, examples and benchmarks.

    path = tiny_model_dir()                       # 2-layer Qwen2, hidden 64, vocab 512
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)

The directory is an ordinary transformers model directory (config, safetensors weights,
tokenizer files), built once into a cache (``$COMLRL_CACHE`` or ``~/.cache/comlrl``) and reused.
Nothing is downloaded: the tokenizer is a byte-level BPE trained in well under a second on a small
built-in English corpus; the weights are a seeded random initialisation.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Optional

import torch

__all__ = ["tiny_model_dir", "build_tiny_tokenizer", "build_tiny_model", "cache_root"]

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
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.{uuid.uuid4().hex[:8]}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target

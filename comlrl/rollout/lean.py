"""A lean decode step for Llama-family causal LMs, the rollout's inner loop without per-call overhead.

Sampling spends one model forward per new token. For the small batches of RL rollouts,
transformers' forward is dominated by per-call bookkeeping (mask construction, cache objects,
module hooks), not by arithmetic: on a 2-layer model it takes ~2 ms per token where the matrix
products take microseconds. :class:`StaticDecoder` runs the same computation (same weights, same
operations in the same order: RMSNorm in float32, rotary embedding, scaled-dot-product attention
over the cache, SiLU MLP, residuals) directly on the model's own parameter tensors (no copies)
with a pre-allocated key/value cache, so a step is a fixed short list of tensor operations.

Scope: ``transformers`` models of type ``qwen2``, ``llama`` or ``mistral`` with full attention, SiLU
MLP and a non-dynamic rotary embedding, plain or as comlrl's LoRA agents (:class:`comlrl.adapters.AdapterAgent`:
vanilla LoRA on any of the projections, computed as peft does, ``base(x) + B(A(x)) * scaling``, or, for
layers small enough to fuse, as one product with ``W + scaling * B @ A`` in a fused copy built for each
rollout; the module's own weights are never modified). The prompt is still encoded by the
model's own forward (so every masking rule of the prefill is transformers'); only the one-token
steps run here. Every model is checked once per process: the first step is computed both ways and
must agree within float tolerance, else the rollout falls back to the transformers loop (with a
warning). ``rollout_backend="hf"`` forces the transformers loop everywhere.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = ["StaticDecoder", "supports_static_decoding"]

logger = logging.getLogger("comlrl")

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "mistral")
_STATIC_ROPE_TYPES = ("default", "linear", "llama3")
# id(model) -> verdict of the one-time check against the transformers forward.
_VERIFIED: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def _plain_view(model: torch.nn.Module) -> tuple[Optional[torch.nn.Module], Optional[str]]:
    """The transformers model whose modules the steps read, and the LoRA adapter they add: ``(model,
    None)`` for a plain model, ``(shared base, adapter name)`` for one of comlrl's LoRA agents, and
    ``(None, None)`` for any other adapter wrapping (a bare ``PeftModel``, transformers' own adapters)."""
    from ..adapters import AdapterAgent

    if isinstance(model, AdapterAgent):
        return model.get_base_model(), model.adapter_name
    if getattr(model, "peft_config", None) or getattr(model, "_hf_peft_config_loaded", False):
        return None, None
    return model, None


# A projection as the steps compute it: (weight, bias, lora), lora = (A [r, in], B [out, r], B's bias,
# scaling) or None; the output is F.linear(x, weight, bias) + F.linear(F.linear(x, A), B, B bias) * scaling.
_Projection = tuple[torch.Tensor, Optional[torch.Tensor], Optional[tuple[torch.Tensor, torch.Tensor,
                                                                         Optional[torch.Tensor], float]]]


def _projection(module: torch.nn.Module, adapter: Optional[str]) -> Optional[_Projection]:
    """``module``'s weights for the steps, or None if they cannot compute it: a plain ``nn.Linear``, or
    (for ``adapter``) a peft LoRA ``Linear`` over one, vanilla (no DoRA or other variant), unmerged,
    adapters enabled. A layer without this adapter is its base layer."""
    if type(module) is torch.nn.Linear:
        return module.weight, module.bias, None
    if adapter is None or type(module).__module__ != "peft.tuners.lora.layer" or type(module).__name__ != "Linear":
        return None
    base = getattr(module, "base_layer", None)
    if type(base) is not torch.nn.Linear or module.merged or module.disable_adapters \
            or adapter in getattr(module, "lora_variant", {}):
        return None
    if adapter not in module.lora_A:
        return base.weight, base.bias, None
    a, b = module.lora_A[adapter], module.lora_B[adapter]
    if type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear or a.bias is not None \
            or a.weight.dtype != base.weight.dtype:
        return None
    return base.weight, base.bias, (a.weight, b.weight, b.bias, float(module.scaling[adapter]))


def _project(x: torch.Tensor, projection: _Projection) -> torch.Tensor:
    """One projection of :func:`_projection` on ``x`` ``[R, in]`` -> ``[R, out]`` (sampling runs in eval
    mode: LoRA dropout is the identity)."""
    weight, bias, lora = projection
    out = F.linear(x, weight, bias)
    if lora is not None:
        a, b, b_bias, scaling = lora
        out = out + F.linear(F.linear(x, a), b, b_bias) * scaling
    return out


def _merged(projection: _Projection) -> _Projection:
    """``projection`` as one product: ``weight + (B @ A) * scaling`` (a new tensor; the module's own
    weights are untouched), the same function up to float rounding."""
    weight, bias, lora = projection
    if lora is None:
        return projection
    a, b, b_bias, scaling = lora
    if b_bias is not None:
        bias = b_bias * scaling if bias is None else bias + b_bias * scaling
    return torch.addmm(weight, b, a, alpha=scaling), bias, None


def supports_static_decoding(model: torch.nn.Module) -> Optional[str]:
    """None if :class:`StaticDecoder` can run ``model``; otherwise the reason it cannot."""
    model, adapter = _plain_view(model)
    if model is None:
        return "adapters injected into the model (comlrl's LoRA agents decode here; other wrappings do not)"
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "not a plain transformers causal LM (wrapped or customised)"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ["full_attention"])):
        return "sliding-window layers"
    if getattr(config, "use_sliding_window", False) or (model_type == "mistral" and config.sliding_window):
        return "sliding-window attention"
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") not in _STATIC_ROPE_TYPES:
        return f"rope type {getattr(rotary, 'rope_type', None)!r}"
    if any(getattr(layer.self_attn, name, None) is not None for layer in inner.layers
           for name in ("q_norm", "k_norm")):
        return "query/key norms"
    # The steps read the modules' weights directly, so every module must compute exactly
    # F.linear (+ a vanilla LoRA term) / RMSNorm on them: no hooks, no quantised or offloaded weights.
    if type(model.lm_head) is not torch.nn.Linear or type(inner.embed_tokens) is not torch.nn.Embedding:
        return "an embedding or output head that is not plain nn.Embedding / nn.Linear (adapters, quantisation)"
    if any(_projection(m, adapter) is None for layer in inner.layers for m in _projections(layer)):
        return "projections that are neither nn.Linear nor vanilla LoRA over one (quantisation, DoRA, merged adapters)"
    norms = [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(not hasattr(n, "variance_epsilon") or not isinstance(getattr(n, "weight", None), torch.Tensor)
           for n in norms):
        return "unrecognised normalisation layers"
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "forward hooks"
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or next(iter(devices)).type == "meta":
        return "weights on several devices or not materialised"
    return None


def _projections(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """A decoder layer's seven projections: q, k, v, o, gate, up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, scaled by the weight in the input dtype."""
    if x.dtype == torch.float32:  # the casts are no-ops: skip their calls
        return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


# Fuse q/k/v and gate/up projections into one matrix product each (a copy of those weights per
# rollout) when the copy is at most this many bytes; larger models run the products separately.
FUSE_LIMIT_BYTES = 256 * 2**20
# Per-step rotary tables ([rows, heads + kv_heads, head_dim] each) are built for all steps at once
# up to this many bytes, else one step at a time (large batches x many heads x long completions).
ROTARY_TABLES_BYTES = 32 * 2**20
# StackedDecoder copies the agents' embedding tables (and output heads) into one stacked tensor
# per rollout when they take at most this many bytes together.
STACK_TABLES_BYTES = 16 * 2**20


class _CachedDecoder:
    """What every decoder here shares: the prompt caches of one or more models (same layout)
    copied into one pre-allocated key/value buffer per layer, rows ``[agent][row]``, prompts
    aligned on the right; the additive attention bias; the rotary tables for every step; and one
    layer's rotary + cache write + attention."""

    def __init__(self, models: list[torch.nn.Module], prompt_caches: list[Any], prompt_masks: list[torch.Tensor],
                 first_positions: list[torch.Tensor], max_new_tokens: int):
        first = models[0]
        config = first.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = self.head_dim ** -0.5
        self.rows = prompt_masks[0].shape[0]  # per model
        if any(m.shape[0] != self.rows for m in prompt_masks):
            raise ValueError("every agent needs the same number of rows")
        prompt_len = max(m.shape[1] for m in prompt_masks)
        self.length = prompt_len  # filled cache positions
        self.step_index = 0
        capacity = prompt_len + max_new_tokens
        device = prompt_masks[0].device
        rows_all = len(models) * self.rows
        self.keys, self.values = [], []
        for i in range(len(first.model.layers)):
            kb = prompt_caches[0].layers[i].keys.new_zeros(rows_all, self.kv_heads, capacity, self.head_dim)
            vb = torch.zeros_like(kb)
            for a, cache in enumerate(prompt_caches):
                k, v = cache.layers[i].keys, cache.layers[i].values
                if k.shape[:2] != (self.rows, self.kv_heads) or k.shape[-1] != self.head_dim:
                    raise ValueError(f"unexpected cache layout {tuple(k.shape)}")
                rows = slice(a * self.rows, (a + 1) * self.rows)
                kb[rows, :, prompt_len - k.shape[2]:prompt_len] = k
                vb[rows, :, prompt_len - v.shape[2]:prompt_len] = v
            self.keys.append(kb)
            self.values.append(vb)
        # Attend to real prompt tokens and to every generated position (as the transformers loop
        # does), as an additive bias [rows, 1, 1, capacity].
        allowed = torch.ones(rows_all, capacity, dtype=torch.bool, device=device)
        for a, mask in enumerate(prompt_masks):
            rows = slice(a * self.rows, (a + 1) * self.rows)
            allowed[rows, :prompt_len] = False
            allowed[rows, prompt_len - mask.shape[1]:prompt_len] = mask.bool()
        self.bias = torch.zeros(rows_all, 1, 1, capacity, dtype=torch.float32, device=device) \
            .masked_fill(~allowed[:, None, None, :], -torch.inf)
        # Rotary tables for every step at once (transformers computes them in float32), [rows, T,
        # 1, hd]. Each step expands its slice once to [rows, heads + kv_heads, hd] with the query
        # heads' part carrying the attention scale 1/sqrt(hd), so scores need no scaling op per
        # layer (expanding every step up front would cost heads + kv times the memory).
        dtype = self.keys[0].dtype
        rotary = first.model.rotary_emb
        positions = torch.cat(first_positions).to(torch.float32)[:, None] + torch.arange(
            max_new_tokens, device=device, dtype=torch.float32)[None, :]
        freqs = positions[..., None] * rotary.inv_freq.to(device=device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        cos, sin = emb.cos() * scaling, emb.sin() * scaling  # [rows, T, hd]
        # rotate_half(x) * sin == swap_halves(x) * (sin with its first half negated)
        half = self.head_dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        self.head_scale = torch.cat([torch.full((self.heads, 1), self.scale, device=device),
                                     torch.ones(self.kv_heads, 1, device=device)])  # [heads + kv, 1]
        self.cos, self.sin = cos[:, :, None, :], sin[:, :, None, :]  # float32 [rows, T, 1, hd]
        self.rotary_dtype = dtype
        # The attention's small batched products in float32 for bf16 / fp16 models on the CPU: there
        # torch runs them about 10x slower in bfloat16 than in float32 (2.3 against 0.21 ms for one
        # layer's scores at 8 rows, 7 query heads per kv head, 60 positions); a GPU keeps the dtype.
        self.attend_fp32 = dtype != torch.float32 and device.type == "cpu"
        self.rotary_steps = None
        if 2 * cos.numel() * (self.heads + self.kv_heads) * cos.element_size() <= ROTARY_TABLES_BYTES:
            self.rotary_steps = [self._expand_rotary(t) for t in range(max_new_tokens)]  # all steps at once
        self._rotary_for_step()

    def _expand_rotary(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        return ((self.cos[:, t] * self.head_scale).to(self.rotary_dtype),
                (self.sin[:, t] * self.head_scale).to(self.rotary_dtype))

    def _rotary_for_step(self) -> None:
        """This step's ``(cos, sin)``, ``[rows, heads + kv, hd]`` each, query part scaled."""
        t = min(self.step_index, self.cos.shape[1] - 1)
        self.rotary = self.rotary_steps[t] if self.rotary_steps is not None else self._expand_rotary(t)

    def _attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """Rotary embedding on the query/key part of ``qkv`` (``[rows, (heads + 2 kv) * hd]``, one
        token per row), the new key/value into the cache, and one query per head attending over it;
        returns ``[rows, heads * hd]``."""
        heads, kv, hd = self.heads, self.kv_heads, self.head_dim
        rows, slot, width = qkv.shape[0], self.length, (heads + kv) * hd
        cos, sin = self.rotary
        qk = qkv[:, :width].view(rows, heads + kv, hd)
        qk = qk * cos + qk.view(rows, heads + kv, 2, hd // 2).flip(2).view(rows, heads + kv, hd) * sin
        self.keys[layer].select(2, slot).copy_(qk[:, heads:])
        self.values[layer].select(2, slot).copy_(qkv[:, width:].view(rows, kv, hd))
        # Grouped heads share their kv head; the query is already scaled.
        query, keys, values = (qk[:, :heads].reshape(rows, kv, heads // kv, hd), self.keys[layer][:, :, :slot + 1],
                               self.values[layer][:, :, :slot + 1])
        if self.attend_fp32:
            query, keys, values = query.float(), keys.float(), values.float()
        scores = torch.matmul(query, keys.transpose(-1, -2))
        probs = torch.softmax(scores.float() + self.bias[..., :slot + 1], dim=-1).to(query.dtype)
        out = torch.matmul(probs, values)  # [rows, kv, groups, hd]
        return out.reshape(rows, heads * hd).to(qkv.dtype)

    def _advance(self) -> None:
        self.length += 1
        self.step_index += 1
        self._rotary_for_step()


class StaticDecoder(_CachedDecoder):
    """One-token decode steps over a pre-allocated cache, for one model and one batch of rows.

    Args:
        model: a supported model (see :func:`supports_static_decoding`), in eval mode.
        prompt_cache: the cache the model's prefill forward returned (``layers[i].keys`` /
            ``.values``, ``[R, kv_heads, P, head_dim]``).
        prompt_mask: ``[R, P]`` attention mask of the left-padded prompts.
        first_positions: ``[R]`` position id of each row's first generated token.
        max_new_tokens: decode steps the cache must hold.
    """

    def __init__(self, model: torch.nn.Module, prompt_cache: Any, prompt_mask: torch.Tensor,
                 first_positions: torch.Tensor, max_new_tokens: int):
        plain, adapter = _plain_view(model)
        if plain is None:
            raise ValueError(supports_static_decoding(model))
        super().__init__([plain], [prompt_cache], [prompt_mask], [first_positions], max_new_tokens)
        self.model = plain
        self.inner = plain.model
        fuse = sum(p.numel() * p.element_size() for layer in self.inner.layers
                   for p in (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                             layer.self_attn.v_proj.weight, layer.mlp.gate_proj.weight,
                             layer.mlp.up_proj.weight)) <= FUSE_LIMIT_BYTES
        self.layers = [self._layer_weights(layer, fuse, adapter) for layer in self.inner.layers]

    @staticmethod
    def _layer_weights(layer: torch.nn.Module, fuse: bool, adapter: Optional[str] = None) -> dict[str, Any]:
        """A layer's norms and projections. When the layer is small enough (``fuse``: then copies of
        its weights cost little), q/k/v and gate/up are fused into one product each and LoRA terms
        merged into the copies (refreshed with every rollout, so they follow the training); otherwise
        the steps read the modules' weights in place and add each LoRA term as its own two products."""
        parts = [_projection(m, adapter) for m in _projections(layer)]
        if any(part is None for part in parts):
            raise ValueError("a projection the steps cannot compute")
        if fuse:
            parts = [_merged(part) for part in parts]
        q, k, v, o, gate, up, down = parts
        weights: dict[str, Any] = {
            "ln1": (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
            "ln2": (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
            "o": o, "down": down,
        }
        if fuse:
            qkv = (q, k, v)
            biases = [b for _, b, _ in qkv]
            weights["qkv"] = (torch.cat([w for w, _, _ in qkv]),
                              None if all(b is None for b in biases) else torch.cat(
                                  [b if b is not None else w.new_zeros(w.shape[0]) for w, b, _ in qkv]), None)
            weights["gate_up"] = (torch.cat([gate[0], up[0]]),
                                  None if gate[1] is None and up[1] is None else torch.cat([gate[1], up[1]]), None)
        else:
            weights["split"] = [q, k, v, gate, up]
        return weights

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ``[R]`` (at each row's next position); returns next-token logits ``[R, V]``."""
        x = F.embedding(tokens, self.inner.embed_tokens.weight)  # [R, H]
        for i, w in enumerate(self.layers):
            h = _rms_norm(x, *w["ln1"])
            qkv = _project(h, w["qkv"]) if "qkv" in w else torch.cat([_project(h, p) for p in w["split"][:3]], -1)
            x = x + _project(self._attend(i, qkv), w["o"])
            h = _rms_norm(x, *w["ln2"])
            if "gate_up" in w:
                gate, up = _project(h, w["gate_up"]).chunk(2, dim=-1)
            else:
                gate, up = (_project(h, p) for p in w["split"][3:])
            x = x + _project(F.silu(gate) * up, w["down"])
        self._advance()
        x = _rms_norm(x, self.inner.norm.weight, self.inner.norm.variance_epsilon)
        return F.linear(x, self.model.lm_head.weight, self.model.lm_head.bias)


def static_decoder_for(model: torch.nn.Module, prompt_cache: Any, prompt_mask: torch.Tensor,
                       first_positions: torch.Tensor, max_new_tokens: int) -> Optional[StaticDecoder]:
    """A :class:`StaticDecoder` if ``model`` is supported and not already found to disagree."""
    if supports_static_decoding(model) is not None or _VERIFIED.get(model) is False:
        return None
    try:
        return StaticDecoder(model, prompt_cache, prompt_mask, first_positions, max_new_tokens)
    except (AttributeError, ValueError, IndexError, RuntimeError) as exc:
        _VERIFIED[model] = False
        logger.warning("comlrl: fast decoding is unavailable for %s (%s); using the transformers forward.",
                       type(model).__name__, exc)
        return None


def needs_check(model: torch.nn.Module) -> bool:
    return model not in _VERIFIED


def record_check(model: torch.nn.Module, fast: torch.Tensor, reference: torch.Tensor) -> bool:
    """Compare the first fast step with the transformers step; remember the verdict for ``model``."""
    tolerance = 1e-4 * (1.0 + float(reference.abs().max()))
    if fast.dtype != torch.float32:
        tolerance *= 100  # bf16 / fp16 round differently in fused and unfused attention
    difference = float((fast.float() - reference.float()).abs().max())
    ok = difference <= tolerance
    _VERIFIED[model] = ok
    if not ok:
        logger.warning("comlrl: fast decoding disagrees with the transformers forward for %s by %.3g (> %.3g); "
                       "using the transformers forward.", type(model).__name__, difference, tolerance)
    return ok


def _layout(model: torch.nn.Module) -> tuple:
    """What must be equal for models to decode stacked: architecture, sizes, dtype, device, RoPE."""
    config = model.config
    rotary = model.model.rotary_emb
    return (config.model_type, tuple((n, tuple(p.shape), p.dtype, p.device) for n, p in model.named_parameters()),
            float(getattr(rotary, "attention_scaling", 1.0)), tuple(rotary.inv_freq.tolist()),
            tuple(layer.input_layernorm.variance_epsilon for layer in model.model.layers),
            config.num_attention_heads, getattr(config, "num_key_value_heads", None), getattr(config, "head_dim", None))


def stackable(models: list[torch.nn.Module]) -> bool:
    """True if ``models`` (2 or more) can take their one-token steps together in one
    :class:`StackedDecoder`: all supported, not found to disagree, of one layout, and small enough
    that a stacked copy of their decoder layers (made per rollout) stays under ``FUSE_LIMIT_BYTES``."""
    if len(models) < 2 or any(supports_static_decoding(m) is not None or _VERIFIED.get(m) is False for m in models):
        return False
    if len({id(m) for m in models}) != len(models):
        return False
    plains = [_plain_view(m)[0] for m in models]
    size = sum(p.numel() * p.element_size() for m in plains for p in m.model.layers.parameters())
    return size <= FUSE_LIMIT_BYTES and len({_layout(m) for m in plains}) == 1


class StackedDecoder(_CachedDecoder):
    """One-token steps of N models of one layout at once: the agents' weights stacked on a leading
    dimension, every product a batched matrix product. N agents then cost about the operations
    of one, which is what limits small-batch decoding. LoRA agents' terms are merged into the
    stacked copies (:func:`_merged`), so they decode as plain models do.

    Args:
        models: N models for which :func:`stackable` holds, in eval mode.
        prompt_caches: each model's prefill cache (``[R, kv_heads, P_a, head_dim]`` per layer).
        prompt_masks: ``[R, P_a]`` each; prompts of different lengths are aligned on the right.
        first_positions: ``[R]`` each: position id of the first generated token.
        max_new_tokens: decode steps the cache must hold.
    """

    def __init__(self, models: list[torch.nn.Module], prompt_caches: list[Any], prompt_masks: list[torch.Tensor],
                 first_positions: list[torch.Tensor], max_new_tokens: int):
        views = [_plain_view(m) for m in models]
        models, adapters = [m for m, _ in views], [a for _, a in views]
        super().__init__(models, prompt_caches, prompt_masks, first_positions, max_new_tokens)
        first = models[0]
        self.n = len(models)
        dtype, device = self.keys[0].dtype, self.keys[0].device

        def stack(get):
            return torch.stack([get(m) for m in models])

        # Embeddings and output heads: stacked copies when small (one lookup / one batched product
        # for all agents); per agent, uncopied, when large (large vocabularies are most of the
        # weights, and there a lookup or a product per agent costs the same as stacked).
        embeds = [m.model.embed_tokens.weight for m in models]
        self.vocab_offsets = None
        if sum(e.numel() * e.element_size() for e in embeds) <= STACK_TABLES_BYTES:
            self.embed_all = torch.cat(embeds)  # [N * V_in, H]: agent a's rows from a * V_in
            self.vocab_offsets = torch.arange(self.n, device=device)[:, None] * embeds[0].shape[0]
        self.embeds = embeds
        # float32: each RMSNorm's weight is folded into the product that follows it (rows of the
        # stacked copy scaled once per rollout), one operation less per norm and step; the products
        # then round differently from transformers' by about one ulp, well inside the checked tolerance.
        fold = dtype == torch.float32
        norm_weight = stack(lambda m: m.model.norm.weight)  # [N, H]
        heads_out = [(m.lm_head.weight, m.lm_head.bias) for m in models]
        self.head_all = None
        if sum(w.numel() * w.element_size() for w, _ in heads_out) <= STACK_TABLES_BYTES \
                and all(b is None for _, b in heads_out):
            self.head_all = torch.stack([w.t() for w, _ in heads_out])  # [N, H, V]
            if fold:
                self.head_all = self.head_all * norm_weight[:, :, None]
        self.heads_out = heads_out
        self.norm = (None if fold and self.head_all is not None else norm_weight[:, None, :],
                     first.model.norm.variance_epsilon)
        self.layers = []
        for i in range(len(first.model.layers)):
            def layer(m, i=i):
                return m.model.layers[i]
            # Per projection (q, k, v, o, gate, up, down) and agent: (weight, bias), LoRA merged in.
            parts = list(zip(*[[_merged(_projection(module, adapter))[:2] for module in _projections(layer(m))]
                               for m, adapter in zip(models, adapters)]))

            def weights(j):  # [N, in, out]
                return torch.stack([w for w, _ in parts[j]]).transpose(1, 2)

            def biases(*js):  # [N, 1, sum of outs], zeros for missing ones; None when none has one
                if all(b is None for j in js for _, b in parts[j]):
                    return None
                return torch.cat([torch.stack([b if b is not None else w.new_zeros(w.shape[0])
                                               for w, b in parts[j]])[:, None, :] for j in js], dim=-1)

            qkv_bias, gate_up_bias = biases(0, 1, 2), biases(4, 5)
            ln1 = stack(lambda m: layer(m).input_layernorm.weight)  # [N, H]
            ln2 = stack(lambda m: layer(m).post_attention_layernorm.weight)
            qkv = torch.cat([weights(j) for j in (0, 1, 2)], dim=2)  # [N, H, Q]
            gate_up = torch.cat([weights(4), weights(5)], dim=2)
            self.layers.append({
                "ln1": (None if fold else ln1[:, None, :], layer(first).input_layernorm.variance_epsilon),
                "ln2": (None if fold else ln2[:, None, :], layer(first).post_attention_layernorm.variance_epsilon),
                "qkv": (qkv * ln1[:, :, None] if fold else qkv, qkv_bias),
                "o": (weights(3), biases(3)),
                "gate_up": (gate_up * ln2[:, :, None] if fold else gate_up, gate_up_bias),
                "down": (weights(6), biases(6)),
            })

    @staticmethod
    def _bmm(x: torch.Tensor, weight_bias: tuple[torch.Tensor, Optional[torch.Tensor]]) -> torch.Tensor:
        weight, bias = weight_bias
        return torch.bmm(x, weight) if bias is None else torch.baddbmm(bias, x, weight)

    @staticmethod
    def _residual(x: torch.Tensor, a: torch.Tensor, weight_bias: tuple[torch.Tensor, Optional[torch.Tensor]]
                  ) -> torch.Tensor:
        """``x + a @ weight (+ bias)``, the residual add inside the product."""
        weight, bias = weight_bias
        out = torch.baddbmm(x, a, weight)
        return out if bias is None else out + bias

    @staticmethod
    def _norm(x: torch.Tensor, weight_eps: tuple[Optional[torch.Tensor], float]) -> torch.Tensor:
        weight, eps = weight_eps
        return F.rms_norm(x, (x.shape[-1],), eps=eps) if weight is None else _rms_norm(x, weight, eps)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ``[N, R]``; returns next-token logits ``[N, R, V]``."""
        n, rows = self.n, self.rows
        if self.vocab_offsets is not None:
            x = F.embedding(tokens + self.vocab_offsets, self.embed_all)  # [N, R, H]
        else:
            x = torch.stack([F.embedding(tokens[a], weight) for a, weight in enumerate(self.embeds)])
        for i, w in enumerate(self.layers):
            qkv = self._bmm(self._norm(x, w["ln1"]), w["qkv"]).view(n * rows, -1)
            x = self._residual(x, self._attend(i, qkv).view(n, rows, -1), w["o"])
            gate, up = self._bmm(self._norm(x, w["ln2"]), w["gate_up"]).chunk(2, dim=-1)
            x = self._residual(x, F.silu(gate) * up, w["down"])
        self._advance()
        x = self._norm(x, self.norm)
        if self.head_all is not None:
            return torch.bmm(x, self.head_all)
        return torch.stack([F.linear(x[a], weight, bias) for a, (weight, bias) in enumerate(self.heads_out)])

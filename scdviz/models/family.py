"""What each supported model family needs, read from its config and modules: the one place SCD, the student, the
presses and the evictor ask.

A family decides how a layer's keys and values are made from its attention input, and how attention is read:

  projections   split ``k_proj`` / ``v_proj`` (most), or one fused ``qkv_proj`` (Phi-3/3.5/4-mini)
  biases        on q/k/v (Qwen2/2.5) or none; read from the modules, so a biased Llama is covered too
  q/k norm      none, per head after the projection (Qwen3, Qwen3-MoE, Gemma-3), or over all heads (OLMo-2)
  attention in  the output of ``input_layernorm`` (pre-norm), or the raw residual stream (OLMo-2, post-norm)
  RoPE          rotate-half on the first ``rotary_dim`` dims (partial rotary: Phi-3.5/4-mini 0.75), none on
                NoPE layers (SmolLM3, every 4th layer), and per layer type (Gemma-3: base 10k on sliding layers,
                1M on full ones)
  windows       sliding-window layers (Mistral v0.1, Gemma-2/3, Phi-3-mini-4k, Qwen2 with use_sliding_window)
  softcapping   attention logits squashed by tanh (Gemma-2)

Anything else is refused before any work: ``unsupported`` names the feature (``load_pair`` raises it as a PairError).

Sliding-window layers, by one rule everywhere: they are never compressed (kvpress's own rule for Gemma-3). They
already hold at most W tokens; eviction budgets apply to the full-attention layers. SCD moves every layer, window
layers included, whole: the consumer's own attention mask keeps to the window.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

#: model_type -> the family's name in messages and in the README
SUPPORTED = {
    "llama": "Llama (1/2/3.x)",
    "mistral": "Mistral (v0.1-v0.3)",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "gemma2": "Gemma-2",
    "gemma3_text": "Gemma-3 (text)",
    "phi3": "Phi-3 / 3.5 / 4-mini",
    "olmo2": "OLMo-2",
    "smollm3": "SmolLM3",
    "granite": "Granite",
}


class UnsupportedModel(ValueError):
    """A model this tool cannot serve correctly; the message names the feature."""


@dataclass(frozen=True)
class Family:
    """The features of one loaded model that the methods depend on (see the module's docstring)."""

    model_type: str
    fused_qkv: bool  # one qkv_proj (Phi-3)
    q_norm: str | None  # None, "head" (per head, Qwen3 / Gemma-3) or "full" (over all heads, OLMo-2)
    k_norm: str | None
    pre_norm: bool  # attention reads input_layernorm's output (False: the residual stream itself, OLMo-2)
    head_dim: int
    rotary_dim: int  # dims rotated by RoPE (< head_dim: partial rotary)
    rope: tuple[bool, ...]  # per layer: RoPE applied (False: a NoPE layer)
    layer_types: tuple[str, ...]  # per layer: "full_attention" or "sliding_attention"
    window: int | None  # the sliding window (tokens), None without sliding layers
    softcap: float | None  # attention logit softcapping (Gemma-2)
    rope_per_type: bool  # one RoPE per layer type (Gemma-3)

    def sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends over a sliding window (and is therefore never compressed)."""
        return self.layer_types[layer] == "sliding_attention"

    @property
    def full_layers(self) -> list[int]:
        """The layers eviction compresses (those without a sliding window)."""
        return [i for i, t in enumerate(self.layer_types) if t != "sliding_attention"]


def unsupported(config) -> str | None:
    """Why a model with this (transformers) config is refused, or None for a supported one."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED:
        known = ", ".join(SUPPORTED.values())
        return (f"model type {kind!r} is not supported (its attention, caches or RoPE are not modelled here); "
                f"supported: {known}")
    if getattr(cfg, "attention_chunk_size", None):
        return f"{SUPPORTED[kind]} with chunked attention (attention_chunk_size) is not supported"
    types = set(getattr(cfg, "layer_types", None) or ())
    if types - {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(types)} are not supported (only full and sliding-window attention)"
    return None


def check(config) -> None:
    """Raise UnsupportedModel for a refused config (``unsupported``)."""
    why = unsupported(config)
    if why:
        raise UnsupportedModel(why)


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Family (read once: a pure function
_BY_ATTENTION: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # of its config and module layout)


def of(model) -> Family:
    """The family of a loaded *ForCausalLM (also under a peft wrapper); UnsupportedModel for a refused one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    found = _CACHE.get(base)
    if found is None:
        found = _CACHE[base] = _read(base)
        for layer in base.model.layers:
            _BY_ATTENTION[layer.self_attn] = found
    return found


def of_attention(module) -> Family | None:
    """The family of the model an attention module belongs to, once ``of(model)`` has read it (else None)."""
    return _BY_ATTENTION.get(module)


def _read(model) -> Family:
    cfg = model.config
    check(cfg)
    layers = list(model.model.layers)
    attn = layers[0].self_attn
    n = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope_params = getattr(cfg, "rope_parameters", None) or {}
    if cfg.model_type == "gemma3_text":  # one parameter set per layer type
        rope_params = rope_params.get("full_attention", rope_params)
    partial = rope_params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
    rotary_dim = int(head_dim * partial)
    if cfg.model_type == "smollm3":
        rope = tuple(bool(x) for x in cfg.no_rope_layers[:n])
    else:
        rope = (True,) * n
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if cfg.model_type == "smollm3" and not getattr(cfg, "use_sliding_window", False):
        types = None
        window = None
    if not types:
        types = ["sliding_attention" if window else "full_attention"] * n
    if "sliding_attention" not in types:
        window = None
    return Family(
        model_type=cfg.model_type,
        fused_qkv=hasattr(attn, "qkv_proj"),
        q_norm=_norm_kind(attn, "q_norm", head_dim),
        k_norm=_norm_kind(attn, "k_norm", head_dim),
        pre_norm=hasattr(layers[0], "input_layernorm"),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope=rope,
        layer_types=tuple(types[:n]),
        window=window,
        softcap=getattr(cfg, "attn_logit_softcapping", None),
        rope_per_type=cfg.model_type == "gemma3_text",
    )


def _norm_kind(attn, name: str, head_dim: int) -> str | None:
    norm = getattr(attn, name, None)
    if norm is None:
        return None
    width = norm.weight.shape[0] if getattr(norm, "weight", None) is not None else head_dim
    return "head" if width == head_dim else "full"

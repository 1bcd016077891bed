"""The ONE module that touches transformers internals (hook points, cache layout, RoPE).

transformers changes its cache API often; everything that knows about
``model.model.layers[l].input_layernorm``, ``self_attn.k_proj``, ``DynamicCache.layers``,
``rotary_emb`` or kwarg names lives here, so a new transformers release is mended in
one file. Written for transformers 5.2 and the decoder-only families of ``scdviz.models.family`` (what each
needs: fused or split projections, biases, q/k norms, pre- or post-norm, partial rotary, NoPE layers,
RoPE per layer type, sliding windows, softcapping); every function here asks that registry.

Shapes (B batch, T tokens, H query heads, Hkv KV heads, D head_dim, d hidden):
  keys / values          (B, Hkv, T, D)    keys after RoPE unless named ``keys_pre``
  h_in / resid           (B, T, d)
  attn                   (B, H, T_query, T_key)
  logits                 (B, T, V)

Threads: a loaded model may be shared by many requests (the app serves many users).
Hooks live on the shared modules, so every function here that runs a model holds that
model's re-entrant work lock (``exclusive``) while it does: a forward pass with its
capture hooks, or a whole ``attention_hook`` / ``eager`` block, never overlaps another
thread's use of the same model. Nothing per request is left on a model afterwards.

What it does not do: choose what to send between models (scdviz.scd), score tokens
(scdviz.evict), or load models (scdviz.models.pair).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from scdviz.models import family as families

CAPTURE_ALL = frozenset({"keys_pre", "h_in", "resid"})


@dataclass
class Trace:
    """What one forward pass produced, read per layer. Lists are indexed by layer."""

    logits: Tensor  # (B, T, V)
    cache: DynamicCache  # the cache after the pass (holds post-RoPE keys and values)
    positions: Tensor  # (B, T) position ids used for the new tokens
    keys_pre: list[Tensor] = field(default_factory=list)  # (B, Hkv, T, D) before RoPE
    h_in: list[Tensor] = field(default_factory=list)  # (B, T, d) output of input_layernorm
    resid: list[Tensor] = field(default_factory=list)  # (B, T, d) residual stream entering layer l;
    #   one more entry at the end: the stream entering the final norm
    attn: list[Tensor] = field(default_factory=list)  # (B, H, T, T_key), only when asked (eager)

    @property
    def keys(self) -> list[Tensor]:
        """Post-RoPE keys per layer, (B, Hkv, T_cache, D), read from the cache."""
        return cache_kv(self.cache)[0]

    @property
    def values(self) -> list[Tensor]:
        """Values per layer, (B, Hkv, T_cache, D), read from the cache."""
        return cache_kv(self.cache)[1]


# ----------------------------------------------------------------------------- threads

_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its RLock
_LOCKS_GUARD = threading.Lock()


def _fresh_locks() -> None:
    """In a forked child (a ZeroGPU worker): model locks of its own, never a copy of one a thread of the parent
    held at the fork (it would never be released there)."""
    global _LOCKS_GUARD
    _LOCKS_GUARD = threading.Lock()
    _LOCKS.clear()


os.register_at_fork(after_in_child=_fresh_locks)


def _lock_of(model) -> threading.RLock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


@contextlib.contextmanager
def exclusive(*models):
    """Hold the work locks of ``models`` (re-entrant, taken in one global order) for a block.

    Use it around several calls that must see no other thread's hooks or attention
    setting in between; single calls of this module take it themselves.
    """
    with contextlib.ExitStack() as stack:
        for model in sorted(set(models), key=id):
            stack.enter_context(_lock_of(model))
        yield


def _one_at_a_time(fn):
    """Run ``fn(model, ...)`` holding the model's work lock."""

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        with _lock_of(model):
            return fn(model, *args, **kwargs)

    return wrapper


# ----------------------------------------------------------------------------- device and dtype

HOST = torch.device("cpu")  # where host-side data lives: token ids from text, payload bytes, SCD codes


def device_of(model) -> torch.device:
    """The device of a model's weights: every tensor that meets the model is made there."""
    return next(model.parameters()).device


def dtype_of(model) -> torch.dtype:
    """The floating dtype of a model's weights (bf16 on CUDA, fp32 on CPU, as loaded)."""
    return next(model.parameters()).dtype


def ids_tensor(ids, device=HOST) -> Tensor:
    """Token ids (a list, or a list of lists) as a (B, T) long tensor on ``device``."""
    ids = list(ids)
    rows = ids if ids and isinstance(ids[0], list | tuple) else [ids]
    return torch.tensor(rows, dtype=torch.long, device=device)


# ----------------------------------------------------------------------------- structure


def decoder(model):
    """The decoder stack (``model.model``) of a *ForCausalLM (also under a peft wrapper)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


def layers(model) -> list:
    """Decoder layers in order."""
    return list(decoder(model).layers)


def n_layers(model) -> int:
    """Number of decoder layers."""
    return len(decoder(model).layers)


def attn_heads(model) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of the model."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_attention_heads, cfg.num_key_value_heads, head_dim


def family(model) -> families.Family:
    """What the model's family needs (``scdviz.models.family``); UnsupportedModel for a refused one."""
    return families.of(model)


def full_layers(model) -> list[int]:
    """The layers eviction compresses: all but the sliding-window ones (those are never compressed)."""
    return family(model).full_layers


def is_window_layer(module) -> bool:
    """Whether an attention module (``layer_idx`` set) attends over a sliding window (never compressed)."""
    found = families.of_attention(module)
    return found is not None and found.sliding(module.layer_idx)


ROWS = "scdviz_rows"  # attention with its probabilities, without eager's per-head copies (``_rows_attention``)


def _rows_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention that returns its probabilities (B, H, n, T), as eager does, without eager's copy of the keys
    and values per query head (``repeat_kv``): q·k grouped by KV head, the softmax in float32 (eager's), the
    output from those probabilities. The FLOPs of the attention itself, nothing recomputed; meant for few query
    rows (decode steps): for n rows it builds the (B, H, n, T) matrix eager builds."""
    b, h, n, _ = query.shape
    n_kv, t = key.shape[1], key.shape[2]
    probs = _grouped_probabilities(query, key, scaling, attention_mask, kwargs.get("softcap")).to(query.dtype)
    out = torch.matmul(probs.reshape(b, n_kv, h // n_kv * n, t), value).reshape(b, h, n, value.shape[-1])
    return out.transpose(1, 2).contiguous(), probs


def _grouped_probabilities(query: Tensor, key: Tensor, scaling: float | None, attention_mask=None,
                           softcap: float | None = None, window: int | None = None) -> Tensor:
    """(B, H, n, T) float32 softmax of q·k x scaling for queries (B, H, n, D) over keys (B, Hkv, T, D), grouped by
    KV head (query head i reads KV head i // (H / Hkv), no copies); ``attention_mask`` (boolean or additive), or
    without one the causal pattern with the n queries last (and, with ``window``, only the last ``window`` keys
    up to each query: a sliding-window layer). ``softcap``: logits squashed to softcap x tanh(logits / softcap)
    first, as Gemma-2 does."""
    b, h, n, d = query.shape
    n_kv, t = key.shape[1], key.shape[2]
    scaling = d ** -0.5 if scaling is None else scaling
    scores = (torch.matmul(query.reshape(b, n_kv, h // n_kv * n, d), key.transpose(-1, -2)) * scaling)
    scores = scores.reshape(b, h, n, t)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[..., :t]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    elif n > 1 or (window and window < t):
        seen = torch.ones(n, t, dtype=torch.bool, device=scores.device).tril(t - n)
        if window and window < t:
            seen &= ~torch.ones(n, t, dtype=torch.bool, device=scores.device).tril(t - n - window)
        scores = scores.masked_fill(~seen, float("-inf"))
    return torch.softmax(scores, -1, dtype=torch.float32)


@functools.cache
def _register_rows() -> None:
    """Make ``ROWS`` an attention implementation transformers knows (its masks: SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ROWS, _rows_attention)
    AttentionMaskInterface.register(ROWS, sdpa_mask)


def set_eager(model) -> None:
    """Use eager attention for good (a model this caller owns; shared models: ``eager``)."""
    model.set_attn_implementation("eager")


@contextlib.contextmanager
def eager(model):
    """Eager attention (the only one returning attention probabilities) inside the block (``attention``)."""
    with attention(model, "eager"):
        yield model


@contextlib.contextmanager
def attention(model, implementation: str):
    """The model runs ``implementation`` attention inside the block: "eager", "sdpa", or ``ROWS``
    (attention that returns its probabilities without eager's per-head copies: decode steps that need them).

    Holds the model's work lock throughout and restores the previous implementation on
    exit, so a shared model is never left switched for other requests.
    """
    if implementation not in ("sdpa", "eager", ROWS):
        raise ValueError(f"unknown attention implementation {implementation!r}; use sdpa, eager or {ROWS}")
    if implementation == ROWS:
        _register_rows()
    with _lock_of(model):
        before = model.config._attn_implementation
        _attention(model, implementation)
        try:
            yield model
        finally:
            _attention(model, before)


def projected(model, layer_idx: int, h_in: Tensor, which: str) -> Tensor:
    """One layer's queries, keys or values (``which``: "q", "k", "v") before RoPE, (B, n_heads, T, D), from the
    layer's attention input ``h_in`` (B, T, d), as the layer makes them: split or fused projection with its bias,
    then its q/k norm (per head or over all heads)."""
    return _projected(layers(model)[layer_idx].self_attn, family(model), h_in, which)


def _fused_rows(cfg, head_dim: int, which: str) -> slice:
    """The rows of a fused qkv_proj (Phi-3) that make the queries, keys or values (``which``: "q", "k", "v")."""
    q_end, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    lo, hi = {"q": (0, q_end), "k": (q_end, q_end + kv), "v": (q_end + kv, q_end + 2 * kv)}[which]
    return slice(lo, hi)


def _projected(attn, fam: families.Family, h_in: Tensor, which: str) -> Tensor:
    b, t = h_in.shape[:2]
    d = fam.head_dim
    if fam.fused_qkv:
        x = attn.qkv_proj(h_in)[..., _fused_rows(attn.config, d, which)]
    else:
        x = getattr(attn, f"{which}_proj")(h_in)
    norm = {"q": fam.q_norm, "k": fam.k_norm}.get(which)
    if norm == "full":
        x = getattr(attn, f"{which}_norm")(x)
    x = x.view(b, t, -1, d)
    if norm == "head":
        x = getattr(attn, f"{which}_norm")(x)
    return x.transpose(1, 2)


# ----------------------------------------------------------------------------- RoPE


def rope(model, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (B, T, R) for integer positions (B, T), in the model's dtype: the RoPE of ``layer``'s
    type (Gemma-3 has one per layer type), R the rotated dims (< head_dim under partial rotary). A NoPE layer
    has none: use ``Rope``, which knows."""
    dummy = torch.zeros(1, dtype=dtype_of(model), device=device_of(model))
    fam = family(model)
    if fam.rope_per_type:
        return decoder(model).rotary_emb(dummy, positions.to(device_of(model)), fam.layer_types[layer])
    return decoder(model).rotary_emb(dummy, positions.to(device_of(model)))


class Rope:
    """A model's RoPE at some positions (B, T), per layer: ``rotate(layer, keys_pre)`` / ``unrotate(layer, keys)``
    apply it as that layer does (its layer type's RoPE, partial rotary, nothing on a NoPE layer), in the keys'
    dtype and device. cos/sin are computed once per layer type."""

    def __init__(self, model, positions: Tensor):
        self.model, self.positions, self.family = model, positions, family(model)
        self._by_type: dict = {}

    def cos_sin(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """(cos, sin) of ``layer`` (None on a NoPE layer)."""
        if not self.family.rope[layer]:
            return None
        kind = self.family.layer_types[layer] if self.family.rope_per_type else None
        if kind not in self._by_type:
            self._by_type[kind] = rope(self.model, self.positions, layer)
        return self._by_type[kind]

    def rotate(self, layer: int, keys_pre: Tensor) -> Tensor:
        """RoPE applied to pre-RoPE keys (or queries) (B, heads, T, D) of ``layer``."""
        cs = self.cos_sin(layer)
        return keys_pre if cs is None else rotate(keys_pre, *(c.to(keys_pre) for c in cs))

    def unrotate(self, layer: int, keys: Tensor) -> Tensor:
        """The inverse of ``rotate``."""
        cs = self.cos_sin(layer)
        return keys if cs is None else unrotate(keys, *(c.to(keys) for c in cs))


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(keys_pre: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply RoPE: keys (B, Hkv, T, D) with cos/sin (B, T, R); R < D rotates the first R dims only (partial
    rotary, Phi-3.5/4-mini), the rest pass through."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r < keys_pre.shape[-1]:
        return torch.cat([rotate(keys_pre[..., :r], cos[:, 0], sin[:, 0]), keys_pre[..., r:]], -1)
    return keys_pre * cos + _rotate_half(keys_pre) * sin


def unrotate(keys: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Inverse of ``rotate`` (rotation by the negative angle)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r < keys.shape[-1]:
        return torch.cat([unrotate(keys[..., :r], cos[:, 0], sin[:, 0]), keys[..., r:]], -1)
    return keys * cos - _rotate_half(keys) * sin


def window_rows(module, hidden: Tensor, keys: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """(B, H, W, Tk) the attention probabilities of the last W tokens of a prefill, computed from their normalised
    inputs ``hidden`` (B, W, d) with ``module`` (an attention layer)'s own q_proj (and q_norm), RoPE ``cos`` /
    ``sin`` (B, W, D) of their positions, over the layer's post-RoPE ``keys`` (B, Hkv, Tk, D), whose last W are
    theirs (the causal pattern). SnapKV's observation window, for a prefill that ran SDPA (no probabilities):
    W query rows, not Tk, so its cost is 2 W H D per cached token, plus W q-projections.

    The layer's family decides the rest (``scdviz.models.family``): fused or biased projections, q-norm, no RoPE
    on a NoPE layer (``cos`` / ``sin`` ignored there), logit softcapping, and a sliding window (keys further back
    than it get no probability).
    """
    fam = families.of_attention(module)
    if fam is None:
        raise ValueError("window_rows: the attention module's model was never read (call hf.family(model) first)")
    layer = module.layer_idx
    with torch.no_grad():
        q = _projected(module, fam, hidden, "q")
        if fam.rope[layer]:
            q = rotate(q, cos, sin)
        return _grouped_probabilities(q, keys, module.scaling, softcap=fam.softcap,
                                      window=fam.window if fam.sliding(layer) else None)


def window_rows_at(model, layer_idx: int, hidden: Tensor, keys: Tensor) -> Tensor:
    """``window_rows`` of layer ``layer_idx`` for the last ``hidden.shape[1]`` tokens of a prefill from position 0
    whose keys are ``keys`` (all Tk of them, unpruned)."""
    w, tk = hidden.shape[1], keys.shape[2]
    positions = torch.arange(tk - w, tk, device=keys.device).view(1, w).expand(hidden.shape[0], w)
    cos, sin = rope(model, positions, layer_idx)
    return window_rows(layers(model)[layer_idx].self_attn, hidden, keys, cos.to(keys.device), sin.to(keys.device))


# ----------------------------------------------------------------------------- cache


class WholeWindowLayer(DynamicLayer):
    """A sliding-window layer of a cache that keeps every token it is given.

    transformers' own sliding layer keeps the last W - 1 tokens; the methods here measure, move and rebuild every
    token the hooks see, so the caches scdviz makes keep them all and leave the window to the attention mask
    (transformers builds it from the config, over cache indices: exact while index = position, which holds
    because window layers are never pruned). ``is_sliding`` makes transformers take this layer's sizes for the
    sliding mask and a full layer's for the causal one."""

    is_sliding = True


def new_cache(model) -> DynamicCache:
    """An empty cache for ``model``: one full layer per full-attention layer, one ``WholeWindowLayer`` per
    sliding-window layer."""
    fam = family(model)
    cache = DynamicCache(config=model.config)
    if fam.window is not None:
        cache.layers = [WholeWindowLayer() if fam.sliding(i) else DynamicLayer() for i in range(len(fam.layer_types))]
    return cache


def make_cache(model, keys: list[Tensor], values: list[Tensor]) -> DynamicCache:
    """A cache (``new_cache``) holding the given per-layer post-RoPE keys and values.

    Each layer may hold a different number of tokens (pruned caches); positions of the
    tokens are whatever RoPE the keys carry.
    """
    cache = new_cache(model)
    for idx, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k, v, idx)
    return cache


def clone_cache(model, cache: DynamicCache) -> DynamicCache:
    """An independent copy (forward passes append to a cache in place)."""
    keys, values = cache_kv(cache)
    return make_cache(model, [k.clone() for k in keys], [v.clone() for v in values])


def cache_len(cache: DynamicCache) -> list[int]:
    """Tokens held per layer."""
    return [int(lyr.keys.shape[-2]) for lyr in cache.layers]


def cache_kv(cache: DynamicCache) -> tuple[list[Tensor], list[Tensor]]:
    """(keys, values) per layer, each (B, Hkv, T_layer, D), keys after RoPE."""
    return [lyr.keys for lyr in cache.layers], [lyr.values for lyr in cache.layers]


def layer_kv(cache: DynamicCache, layer: int) -> tuple[Tensor, Tensor]:
    """(keys, values) of one layer of the cache."""
    lyr = cache.layers[layer]
    return lyr.keys, lyr.values


def set_layer_kv(cache: DynamicCache, layer: int, keys: Tensor, values: Tensor) -> None:
    """Replace one layer's keys and values in place (pruning). A sliding-window layer is never pruned: a
    ValueError for one whose token count would change (its attention mask is built over cache indices)."""
    lyr = cache.layers[layer]
    if getattr(lyr, "is_sliding", False) and keys.shape[-2] != lyr.keys.shape[-2]:
        raise ValueError(f"layer {layer} attends over a sliding window: window layers are never compressed "
                         "(their cache is already bounded); compress the full-attention layers (hf.full_layers)")
    lyr.keys, lyr.values = keys, values


# ----------------------------------------------------------------------------- forward


@contextlib.contextmanager
def _hooks(model, capture: frozenset, attentions: bool, trace_lists: dict):
    """Register capture hooks for the duration of one forward pass; always removed.

    ``h_in`` is what the attention layer reads (input_layernorm's output, or the residual stream itself in a
    post-norm family), taken at the attention module's input; ``keys_pre`` are made from it as the layer makes
    them (``projected``: bias, fused projection, k-norm included), bit for bit the layer's own."""
    handles = []
    stack = layers(model)
    fam = family(model)

    def keep_input(idx):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            if "h_in" in capture:
                trace_lists["h_in"][idx] = h
            if "keys_pre" in capture:
                trace_lists["keys_pre"][idx] = _projected(module, fam, h, "k")

        return hook

    def keep_resid(idx):
        def hook(_module, args, kwargs):
            trace_lists["resid"][idx] = args[0] if args else kwargs["hidden_states"]

        return hook

    def keep_attn(idx):
        def hook(_module, _inp, out):
            trace_lists["attn"][idx] = out[1]

        return hook

    try:
        for idx, layer in enumerate(stack):
            if capture & {"keys_pre", "h_in"}:
                handles.append(layer.self_attn.register_forward_pre_hook(keep_input(idx), with_kwargs=True))
            if "resid" in capture:
                handles.append(layer.register_forward_pre_hook(keep_resid(idx), with_kwargs=True))
            if attentions:
                handles.append(layer.self_attn.register_forward_hook(keep_attn(idx)))
        if "resid" in capture:
            handles.append(decoder(model).norm.register_forward_pre_hook(keep_resid(len(stack)), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


@_one_at_a_time
def forward(
    model,
    input_ids: Tensor,
    *,
    cache: DynamicCache | None = None,
    positions: Tensor | None = None,
    capture: frozenset | set = frozenset(),
    attentions: bool = False,
    attention_mask: Tensor | None = None,
    last_logits: bool | int = False,
    grad: bool = False,
) -> Trace:
    """Run the model on ``input_ids`` (B, T) and return a Trace.

    cache: appended to *in place* (clone it first to keep it); a new one when None.
    positions: RoPE positions (B, T) of the new tokens; default continues from the
      cache's length. Pass them explicitly for a pruned cache, whose length is no
      longer the next position.
    capture: subset of {"keys_pre", "h_in", "resid"}.
    attentions: also capture attention probabilities (needs eager or ``ROWS`` attention).
    attention_mask: (B, T_cache + T) 1 for the keys each row may read, 0 for padding (None: all).
    last_logits: the LM head on the last position only (logits (B, 1, V)): a prefill that needs no more; an int
      n: on the last n positions (B, n, V).
    grad: record the autograd graph (training something upstream of the model through it, the model's
      own weights frozen: take gradients with ``torch.autograd.grad`` so none lands on a shared model).
    """
    device = device_of(model)
    input_ids = input_ids.to(device)
    if cache is None:
        cache = new_cache(model)
    if positions is None:
        start = cache.get_seq_length()
        positions = torch.arange(start, start + input_ids.shape[1], device=device).expand(input_ids.shape[0], -1)
    positions = positions.to(device)
    n = n_layers(model) + 1
    lists = {name: [None] * n for name in ("keys_pre", "h_in", "resid", "attn")}
    if attentions and model.config._attn_implementation not in ("eager", ROWS):
        raise ValueError("attention probabilities need eager attention: call hf.set_eager(model) first")
    extra = {}
    if (cache.get_seq_length() and any(isinstance(lyr, WholeWindowLayer) for lyr in cache.layers)
            and len(set(cache_len(cache))) > 1):
        # full layers pruned beside whole window layers: the masks' query indices are the true positions (a
        # window layer's cache index is its token's position; the pruned full layers see every key they hold)
        extra["cache_position"] = positions[0]
    with _hooks(model, frozenset(capture), attentions, lists), torch.set_grad_enabled(grad):
        out = model(input_ids=input_ids, past_key_values=cache, position_ids=positions, use_cache=True,
                    attention_mask=attention_mask, logits_to_keep=int(last_logits), **extra)
    nl = n - 1
    return Trace(
        logits=out.logits,
        cache=cache,
        positions=positions,
        keys_pre=lists["keys_pre"][:nl] if "keys_pre" in capture else [],
        h_in=lists["h_in"][:nl] if "h_in" in capture else [],
        resid=lists["resid"] if "resid" in capture else [],
        attn=lists["attn"][:nl] if attentions else [],
    )


def kv_pre_from_hin(model, layer_idx: int, h_in: Tensor) -> tuple[Tensor, Tensor]:
    """One layer's (pre-RoPE keys, values), each (B, Hkv, T, D), regenerated from its attention input H_in
    (B, T, d) exactly as the layer makes them (``projected``: bias, fused projection, k-norm)."""
    with torch.no_grad():
        return projected(model, layer_idx, h_in, "k"), projected(model, layer_idx, h_in, "v")


@_one_at_a_time
def kv_from_hin(model, layer_idx: int, h_in: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Regenerate one layer's (post-RoPE keys, values) from its attention input H_in.

    h_in (B, T, d) -> keys, values (B, Hkv, T, D): ``kv_pre_from_hin``, then the layer's RoPE at ``positions``
    (B, T) (none on a NoPE layer).
    """
    k, v = kv_pre_from_hin(model, layer_idx, h_in)
    return Rope(model, positions).rotate(layer_idx, k), v


def continue_logits(model, cache: DynamicCache, ids: Tensor, start: int | Tensor,
                    one_at_a_time: bool = False) -> Tensor:
    """Teacher-forced logits (B, n, V) for ``ids`` (B, n) placed at positions start..start+n-1.

    The cache is cloned first, so the caller's cache is not changed. A cache whose layers
    hold different numbers of tokens (per-layer budgets, e.g. PyramidKV) is continued one
    token at a time: transformers builds one attention mask from layer 0's length, which
    misplaces the causal part of a multi-token step on the other layers. ``one_at_a_time``
    asks for that anyway: decoding step by step, e.g. under decode-time eviction.
    """
    positions = _positions(ids, start, device_of(model))
    cache = clone_cache(model, cache)
    if not one_at_a_time and len(set(cache_len(cache))) <= 1:
        return forward(model, ids, cache=cache, positions=positions).logits
    steps = [forward(model, ids[:, i : i + 1], cache=cache, positions=positions[:, i : i + 1]).logits
             for i in range(ids.shape[1])]
    return torch.cat(steps, dim=1)


@contextlib.contextmanager
def press_prefill(model, press, ids: Tensor, attn: str = "sdpa"):
    """Prefill ``ids`` (B, T) under a kvpress press, kvpress's own way; yields the compressed cache.

    For presses that are not plain scorers: per-layer budgets (PyramidKV), head-wise
    budgets (AdaKV, CriticalAdaKV, KVzip), which kvpress applies by masking keys in its
    patched attention functions through ``masked_key_indices`` on each attention module.
    Those masks act on every later forward pass, so continue the cache *inside* the
    block; the model's lock is held throughout and the masks are removed on exit (nothing
    per request stays on a shared model). The prefill runs with ``attn`` attention: sdpa
    (head-wise masking does not cover eager), or eager for a scorer that reads attention
    probabilities (ObservedAttention, DistillCache); inside the block the model runs sdpa,
    as a server decodes; the model's setting is restored afterwards.
    """
    if attn not in ("sdpa", "eager"):
        raise ValueError(f"unknown attention implementation {attn!r}; use sdpa or eager")
    with _lock_of(model):
        before = model.config._attn_implementation
        cache = new_cache(model)
        try:
            _attention(model, attn)
            with torch.no_grad(), press(model), windows_kept(model):
                decoder(model)(input_ids=ids.to(device_of(model)), past_key_values=cache, use_cache=True)
            _attention(model, "sdpa")
            yield cache
        finally:
            for layer in layers(model):
                if getattr(layer.self_attn, "masked_key_indices", None) is not None:
                    layer.self_attn.masked_key_indices = None
            _attention(model, before)


@contextlib.contextmanager
def windows_kept(model):
    """Inside the block, whatever forward hooks registered before it do to a sliding-window layer's cache is undone
    after them: window layers are never compressed (kvpress's rule for Gemma-3, here for every family), so a kvpress
    press entered first (``with press(model), windows_kept(model):``) compresses only the full-attention layers.
    The caller holds the model's lock."""
    fam = family(model)
    handles = []
    kept: dict = {}

    def stash(module, _args, kwargs, _out):
        lyr = kwargs["past_key_values"].layers[module.layer_idx]
        kept[module.layer_idx] = (lyr.keys, lyr.values)

    def restore(module, _args, kwargs, _out):
        lyr = kwargs["past_key_values"].layers[module.layer_idx]
        lyr.keys, lyr.values = kept.pop(module.layer_idx)

    try:
        for idx, layer in enumerate(layers(model)):
            if fam.sliding(idx):
                handles.append(layer.self_attn.register_forward_hook(stash, with_kwargs=True, prepend=True))
                handles.append(layer.self_attn.register_forward_hook(restore, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def _attention(model, implementation: str) -> None:
    """Switch the model's attention implementation when it is another one (the caller holds its lock). SDPA
    cannot softcap logits (transformers 5.2 drops Gemma-2's cap under it, silently): a softcapping family gets
    eager attention where SDPA is asked for."""
    if implementation == "sdpa" and family(model).softcap:
        implementation = "eager"
    if model.config._attn_implementation != implementation:
        model.set_attn_implementation(implementation)


def exact_attention(model) -> None:
    """Give a model that was loaded with SDPA the attention its family computes exactly (eager for a
    softcapping family; nothing changes otherwise). ``load_model`` calls it; call it on a model built by hand."""
    with _lock_of(model):
        _attention(model, model.config._attn_implementation)


def kept_per_head(model, cache: DynamicCache, only: list[int] | None = None) -> float:
    """Mean tokens a cache lets each layer's KV heads attend to: its length less the keys a
    head-wise press masked (``masked_key_indices``, read inside ``press_prefill``); ``only``: over these
    layers alone (the full-attention ones, ``full_layers``), None: every layer."""
    sizes, (b, h) = [], cache.layers[0].keys.shape[:2]
    for idx, (layer, n) in enumerate(zip(layers(model), cache_len(cache), strict=True)):
        if only is not None and idx not in only:
            continue
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        sizes.append(n - (0 if masked is None else len(masked[0]) / (b * h)))
    return sum(sizes) / len(sizes)


@_one_at_a_time
def generate(
    model,
    cache: DynamicCache,
    first_ids: Tensor,
    start: int,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    on_step=None,
) -> list[int]:
    """Greedy decoding for batch size 1, continuing a cache of any length.

    first_ids (1, n): tokens not yet in the cache (at least the last prompt token),
    placed at positions start..start+n-1. on_step(cache, step): optional callback after
    every decode step (decode-time eviction uses it to shrink the cache in place).
    Returns the generated token ids. The caller's cache is cloned first.
    """
    cache = clone_cache(model, cache)
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    ids, pos, out = first_ids, start, []
    for step in range(max_new_tokens):
        logits = forward(model, ids, cache=cache, positions=_positions(ids, pos, device_of(model))).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in eos:
            break
        pos += ids.shape[1]
        ids = torch.tensor([[token]], device=device_of(model))
        if on_step is not None:
            on_step(cache, step)
    return out


@_one_at_a_time
def generate_each(model, caches: list[DynamicCache], first_ids: Tensor, start: int, max_new_tokens: int | list[int],
                  eos_token_id: int | list[int] | None = None) -> list[list[int]]:
    """Greedy decoding from each of several caches (batch size 1 each) after the same ``first_ids`` at
    positions ``start``..: ``[generate(model, c, first_ids, start, n, eos_token_id) for c, n in zip(caches,
    max_new_tokens)]`` (one ``max_new_tokens`` for all, or one per cache), in one batch: a decode step then
    reads the weights once for all of them, on a CPU most of its time. Caches of different lengths (a full
    cache beside pruned ones) are left-padded and the padding masked; a row leaves the batch when it has its
    tokens or its end-of-sequence token; a cache whose layers differ in length is decoded on its own. The
    callers' caches are not changed."""
    wanted = [max_new_tokens] * len(caches) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(wanted) != len(caches):
        raise ValueError(f"max_new_tokens: {len(wanted)} lengths for {len(caches)} caches")
    even = [i for i, c in enumerate(caches) if _batchable(c)]
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    out: list[list[int]] = [[] for _ in caches]
    for i in range(len(caches)):
        if i not in even or len(even) < 2:
            out[i] = generate(model, caches[i], first_ids, start, wanted[i], eos_token_id)
    if len(even) < 2:
        return out

    def done(i):
        return len(out[i]) >= wanted[i] or bool(out[i] and out[i][-1] in eos)

    device = device_of(model)
    batch = [i for i in even if not done(i)]  # the caches whose rows the batch holds, in order
    if not batch:
        return out
    cache, mask = _stacked(model, [caches[i] for i in batch])
    ids, pos = first_ids.to(device).expand(len(batch), -1), start
    while True:
        mask = torch.cat([mask, mask.new_ones(len(batch), ids.shape[1])], 1)
        logits = forward(model, ids, cache=cache, positions=_positions(ids, pos, device), attention_mask=mask).logits
        tokens = logits[:, -1].argmax(-1)
        for i, token in zip(batch, tokens.tolist(), strict=True):
            out[i].append(token)
        pos += ids.shape[1]
        ids = tokens.unsqueeze(1)
        keep = [j for j, i in enumerate(batch) if not done(i)]
        if not keep:
            return out
        if len(keep) < len(batch):  # finished rows leave the batch
            rows = torch.tensor(keep, device=device)
            keys, values = cache_kv(cache)
            cache = make_cache(model, [k[rows] for k in keys], [v[rows] for v in values])
            mask, ids, batch = mask[rows], ids[rows], [batch[j] for j in keep]


def _batchable(cache: DynamicCache) -> bool:
    """A cache ``_stacked`` can batch: batch size 1, one length across its layers."""
    return len(set(cache_len(cache))) == 1 and cache.layers[0].keys.shape[0] == 1


def _stacked(model, caches: list[DynamicCache]) -> tuple[DynamicCache, Tensor]:
    """Caches of batch size 1, each one length across its layers, as one batch: (the cache, left-padded to
    the longest; its (B, width) mask, 1 on real keys)."""
    device, lengths = device_of(model), [cache_len(c)[0] for c in caches]
    width = max(lengths)

    def padded(tensors):  # (1, Hkv, n, D) each -> (B, Hkv, width, D), the padding first
        return torch.cat([torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0)) for t in tensors])

    kv = [cache_kv(c) for c in caches]
    cache = make_cache(model, [padded(layer) for layer in zip(*(k for k, _ in kv), strict=True)],
                       [padded(layer) for layer in zip(*(v for _, v in kv), strict=True)])
    return cache, (torch.arange(width, device=device) >= width - torch.tensor(lengths, device=device)[:, None]).long()


@_one_at_a_time
def continue_each(model, caches: list[DynamicCache], ids: Tensor, start: int) -> list[Tensor]:
    """``[continue_logits(model, c, ids, start)[0] for c in caches]`` (each (n, V)), in one batch per group
    of caches of one length (no padding: a row's logits are those it gets alone, up to a batched matmul's
    rounding; on this project's CPU builds bit for bit); a cache whose layers differ in length is continued
    on its own. The callers' caches are not changed."""
    out: list[Tensor | None] = [None] * len(caches)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(caches):
        groups.setdefault(tuple(cache_len(c)) if _batchable(c) else ("alone", i), []).append(i)
    for key, members in groups.items():
        if key[0] == "alone" or len(members) == 1:
            for i in members:
                out[i] = continue_logits(model, caches[i], ids, start)[0]
            continue
        cache, _ = _stacked(model, [caches[i] for i in members])  # one length: no padding
        logits = forward(model, ids.expand(len(members), -1), cache=cache,
                         positions=_positions(ids, start, device_of(model)).expand(len(members), -1)).logits
        for i, row in zip(members, logits, strict=True):
            out[i] = row
    return out


def _positions(ids: Tensor, start: int | Tensor, device=None) -> Tensor:
    n = ids.shape[1]
    device = device if device is not None else ids.device
    return (torch.arange(n, device=device) + int(start)).unsqueeze(0).expand(ids.shape[0], -1)


# ----------------------------------------------------------------------------- layer-wise


def _causal_mask(t: int, dtype: torch.dtype, device) -> Tensor:
    """Additive causal mask (1, 1, t, t): 0 on and below the diagonal, -inf above."""
    mask = torch.full((t, t), float("-inf"), dtype=dtype, device=device).triu(1)
    return mask[None, None]


@_one_at_a_time
def run_layers(model, resid: Tensor, positions: Tensor, start: int, stop: int) -> tuple[Tensor, list, list]:
    """Run decoder layers start..stop-1 on a residual stream, as a fresh prefill of its tokens.

    resid (B, T, d): the stream entering layer ``start`` (e.g. another model's, for
    DroidSpeak-style recompute); positions (B, T). Full causal attention among the T
    tokens, no cache before them. Returns (stream leaving layer stop-1 (B, T, d),
    post-RoPE keys per layer [(B, Hkv, T, D)], values per layer [(B, Hkv, T, D)]). No autograd graph.
    """
    stack, fam = layers(model), family(model)
    cache = new_cache(model)
    rope_of = Rope(model, positions)
    t = resid.shape[1]
    causal = _causal_mask(t, resid.dtype, resid.device)
    window = causal
    if fam.window is not None and fam.window < t:  # a sliding layer sees the last W tokens up to itself
        window = causal.masked_fill(torch.ones(t, t, dtype=torch.bool, device=resid.device).tril(-fam.window),
                                    float("-inf"))
    hidden = resid
    with torch.no_grad():
        for idx in range(start, stop):
            cs = rope_of.cos_sin(idx) or rope(model, positions, idx)  # a NoPE layer ignores what it is given
            hidden = stack[idx](
                hidden,
                attention_mask=window if fam.sliding(idx) else causal,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=cs,
            )
            if isinstance(hidden, tuple):  # some families' layers return (hidden, ...) (Granite)
                hidden = hidden[0]
    keys, values = cache_kv(cache)
    return hidden, keys[start:stop], values[start:stop]


_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}  # split projection -> the fused module that holds it (Phi-3)


def lora_targets(model, wanted: list[str]) -> list[str]:
    """The decoder's linear modules that adapters on ``wanted`` (split-projection names: q_proj, k_proj, ...) go
    on: the names themselves, or the fused module holding them (Phi-3's qkv_proj, gate_up_proj). ValueError naming
    a target the model has no linear module for (e.g. a mixture-of-experts' expert projections)."""
    present = {name.rsplit(".", 1)[-1] for name, mod in decoder(model).layers.named_modules()
               if isinstance(mod, torch.nn.Linear)}
    out, missing = [], []
    for name in wanted:
        got = name if name in present else _FUSED.get(name) if _FUSED.get(name) in present else None
        if got is None:
            missing.append(name)
        elif got not in out:
            out.append(got)
    if missing:
        raise ValueError(f"this model ({model.config.model_type}) has no linear module for adapter targets "
                         f"{missing}: drop them from --targets (its linear modules: {sorted(present)})")
    return out


def kv_weights(model, layer_idx: int) -> tuple[Tensor, Tensor]:
    """The key and value projection weights of one layer, each (Hkv*D, d) (the rows of a fused qkv_proj; biases
    and k-norm left out: a linear model of K and V, for fitting aligners; ``kv_pre_from_hin`` is the exact
    regeneration)."""
    attn = layers(model)[layer_idx].self_attn
    if family(model).fused_qkv:
        w, d = attn.qkv_proj.weight, family(model).head_dim
        return w[_fused_rows(model.config, d, "k")], w[_fused_rows(model.config, d, "v")]
    return attn.k_proj.weight, attn.v_proj.weight


# ----------------------------------------------------------------------------- attention hooks (eviction)


@contextlib.contextmanager
def attention_hook(model, fn):
    """Call ``fn`` after every attention layer for the duration of the context.

    fn(module, hidden_states, keys, values, attentions, kwargs) follows kvpress's
    ``compress`` signature: hidden_states (B, T, d) the layer's normalised input; keys /
    values (B, Hkv, T_cache, D) the layer's cache *after* this pass appended to it;
    attentions (B, H, T, T_cache) with eager attention, else None; kwargs the attention
    module's keyword arguments (position_embeddings, ...). ``module.layer_idx`` is the
    layer. If fn returns (keys, values), they replace the layer's cache (pruning).
    The module also gets ``rotary_emb`` set, as kvpress's presses expect. Hooks and that
    attribute are removed on exit; the model's work lock is held throughout.
    """
    handles = []
    rotary = decoder(model).rotary_emb

    def hook(module, _args, kwargs, output):
        cache = kwargs["past_key_values"]
        attn = output[1] if len(output) > 1 else None
        new = fn(module, kwargs["hidden_states"], *layer_kv(cache, module.layer_idx), attn, kwargs)
        if new is not None:
            set_layer_kv(cache, module.layer_idx, *new)
        return output

    lock = _lock_of(model)
    added = []  # attention modules that got ``rotary_emb`` from us (removed again on exit)
    with lock:
        try:
            for layer in layers(model):
                attn = layer.self_attn
                if getattr(attn, "rotary_emb", None) is None:
                    attn.rotary_emb = rotary
                    added.append(attn)
                handles.append(attn.register_forward_hook(hook, with_kwargs=True))
            yield
        finally:
            for h in handles:
                h.remove()
            for attn in added:
                del attn.rotary_emb



@_one_at_a_time
def decoder_cache(model, ids: Tensor) -> DynamicCache:
    """Prefill ``ids`` (B, T) at positions 0..T-1 through the decoder only (no LM head): the cache.

    What a server does before the first decode step; the LM head over every prompt
    token would be wasted work (and would inflate a measured prefill time).
    """
    device = device_of(model)
    cache = new_cache(model)
    with torch.no_grad():
        decoder(model)(input_ids=ids.to(device), past_key_values=cache, use_cache=True)
    return cache


def random_llama(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, ffn: int, vocab: int,
                 device="cpu", dtype=torch.bfloat16, seed: int = 0):
    """A Llama-architecture model with random weights, built directly on ``device`` (timing at real
    layer shapes: the time of a forward pass does not depend on the weight values)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab, max_position_embeddings=8192,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval().requires_grad_(False)

"""One eager prefill of a context that serves every eviction method at once.

``observe`` runs the model over a context once with eager attention and, inside a
per-layer hook, computes the DistillCache features (both forms) and the scores of any
number of kvpress scorer presses on the full keys/values (one prefill can
serve every press). ``prune`` builds the pruned cache for a set of kept indices.

With ``lookahead=(G, K)`` it then samples K continuations of G tokens from the full cache
(the model's own distribution, a seeded generator) and appends the attention they pay to
each context token as a sixth feature column (``features.lookahead_attention``): what a
lookahead policy reads. It costs G batched decode steps after the prefill, timed apart
(``lookahead_seconds``).

Sliding-window layers are never compressed (``scdviz.evict.windows``): ``observe`` refuses a model whose every
layer is sliding, scores no press on a window layer (its entry in a score list is None), averages the global
features over the full-attention layers, and ``prune`` keeps every window layer whole whatever its indices say.

Shapes: keys / values per layer (B, Hkv, T, D); per-head features (L, B, Hkv, T, 5);
global features (B, T, 5); scores per layer (B, Hkv, T) (None on a window layer); kept indices per layer
(B, Hkv, n) (None: the layer kept whole) or, for one token set, (B, n). This module does not train or evaluate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from scdviz.evict import features as F
from scdviz.evict import kvpress_limits, windows
from scdviz.evict.policy import compression_ratio
from scdviz.models import hf


@dataclass
class Observed:
    """What one prefill of a context produced."""

    keys: list[Tensor]  # per layer (B, Hkv, T, D), post-RoPE
    values: list[Tensor]  # per layer (B, Hkv, T, D)
    head_features: Tensor  # (L, B, Hkv, T, 5 or 6) per-layer / per-KV-head features (6th: lookahead)
    global_features: Tensor  # (B, T, 5 or 6) averaged over layers and heads
    scores: dict[tuple[str, float], list[Tensor | None]] = field(
        default_factory=dict
    )  # (press, keep) -> per layer (B, Hkv, T); None on a sliding-window layer (never compressed)
    score_seconds: dict[str, float] = field(default_factory=dict)  # press -> time spent scoring (all keeps)
    feature_seconds: float = 0.0  # time spent computing features in the hook
    prefill_seconds: float = 0.0  # wall time of the whole prefill
    lookahead_seconds: float = 0.0  # time spent sampling the lookahead continuations (0 without)
    hidden: list[Tensor] = field(default_factory=list)  # per layer (B, T, d) normalised inputs, when asked
    window_layers: tuple[int, ...] = ()  # the sliding-window layers, never compressed (kept whole by ``prune``)

    @property
    def n_tokens(self) -> int:
        """Context length T."""
        return int(self.keys[0].shape[-2])


def observe(model, ids: Tensor, window: int, presses: dict | None = None, keeps: tuple = (),
            failed: dict | None = None, lookahead: tuple[int, int] = (0, 0), seed: int = 0,
            hidden: bool = False) -> Observed:
    """Prefill ``ids`` (B, T) once (eager attention) and collect features and press scores.

    lookahead: (G, K); G > 0 adds the lookahead feature from K sampled continuations of G
    tokens (batch size 1), drawn with a generator seeded by ``seed``.

    presses: name -> kvpress ScorerPress; each is scored at every kept fraction in
    ``keeps`` (its compression_ratio set accordingly; StreamingLLM's scores depend on it).
    failed: name -> why; a press that raises on this model, or that kvpress_limits refuses for its family, is
    recorded there and left out (its scores dropped), presses already in it are not tried.
    hidden: also keep every layer's normalised input (what a DistillCache student reads).
    Sliding-window layers (``scdviz.evict.windows``): no press scores them (None in the score lists), the global
    features average the full-attention layers; a model with no other layer is refused (ValueError).
    """
    full = windows.compressed_layers(model)
    sliding = tuple(windows.window_layers(model))
    failed = {} if failed is None else failed
    for name, press in (presses or {}).items():  # a press that would rebuild this family's attention wrongly
        if name not in failed and (why := kvpress_limits.refusal(press, model, eager=True)):
            failed[name] = why
    presses = {k: v for k, v in (presses or {}).items() if k not in failed}
    _, n_kv, _ = hf.attn_heads(model)
    head, glob, scores, inputs = [], [], {}, []
    timing = {name: 0.0 for name in presses}
    feat_time = [0.0]

    def on_layer(module, hidden_states, keys, values, attn, kwargs):
        if attn is None:
            raise ValueError("DistillCache features need eager attention: call hf.set_eager(model) first")
        t0 = time.perf_counter()
        head.append(F.prefill_layer_features(attn, values, window, n_kv))
        if module.layer_idx in full:  # the global form: one token set for the layers eviction compresses
            glob.append(F.prefill_layer_features(attn, values, window, 1))
        feat_time[0] += time.perf_counter() - t0
        if hidden:
            inputs.append(hidden_states)
        if module.layer_idx in sliding:  # never compressed: nothing to score
            for name in presses:
                for keep in keeps:
                    scores.setdefault((name, keep), []).append(None)
            return None
        for name, press in presses.items():
            if name in failed:
                continue
            t0 = time.perf_counter()
            try:
                for keep in keeps:
                    press.compression_ratio = compression_ratio(keep)
                    scores.setdefault((name, keep), []).append(
                        press.score(module, hidden_states, keys, values, attn, kwargs))
            except Exception as err:  # a scorer that cannot run on this model: reported by the caller, never fatal
                failed[name] = why_not(err)
            timing[name] += time.perf_counter() - t0
        return None

    start = time.perf_counter()
    with hf.attention_hook(model, on_layer), torch.no_grad():
        trace = hf.forward(model, ids, last_logits=True)  # the lookahead samples from the last position
    prefill_seconds = time.perf_counter() - start
    scores = {k: v for k, v in scores.items() if k[0] not in failed}
    head, glob = torch.stack(head, 0), F.global_features(glob)
    look_seconds = 0.0
    if lookahead[0] > 0:
        t0 = time.perf_counter()
        look = sampled_lookahead(model, trace, *lookahead, seed)  # (L, 1, Hkv, T)
        head = torch.cat([head, look.unsqueeze(-1).to(head.dtype)], -1)
        glob = torch.cat([glob, windows.compressed(model, look).mean((0, 2)).unsqueeze(-1).to(glob.dtype)], -1)
        look_seconds = time.perf_counter() - t0
    return Observed(
        keys=trace.keys,
        values=trace.values,
        head_features=head,
        global_features=glob,
        scores=scores,
        score_seconds={k: v for k, v in timing.items() if k not in failed},
        feature_seconds=feat_time[0],
        prefill_seconds=prefill_seconds,
        lookahead_seconds=look_seconds,
        hidden=inputs,
        window_layers=sliding,
    )


def sampled_lookahead(model, trace, tokens: int, samples: int, seed: int = 0) -> Tensor:
    """The lookahead feature (L, 1, Hkv, T) after a prefill ``trace`` of batch size 1.

    K = ``samples`` continuations of G = ``tokens`` tokens are sampled from the model's own
    next-token distribution (temperature 1) over a copy of the full cache; the attention
    rows of the sampled tokens over the T context tokens are averaged
    (``features.lookahead_attention``). The sampled steps run ``hf.ROWS`` attention (eager's
    probabilities without its copies of the keys and values per query head);
    the trace's cache is not touched.
    """
    if trace.logits.shape[0] != 1:
        raise ValueError("the lookahead feature is computed for one context at a time (batch size 1)")
    if samples < 1:
        raise ValueError(f"the lookahead needs at least one sampled continuation, got {samples}")
    t, (_, n_kv, _) = trace.keys[0].shape[2], hf.attn_heads(model)
    device = trace.logits.device
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = hf.make_cache(model, [k.expand(samples, -1, -1, -1) for k in trace.keys],
                          [v.expand(samples, -1, -1, -1) for v in trace.values])
    logits, rows = trace.logits[:, -1].expand(samples, -1), []
    with torch.no_grad(), hf.attention(model, hf.ROWS):
        for step in range(tokens):
            token = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen)  # (K, 1)
            positions = torch.full((samples, 1), t + step, device=device)
            out = hf.forward(model, token, cache=cache, positions=positions, attentions=True)
            rows.append([a[..., :t] for a in out.attn])
            logits = out.logits[:, -1]
    per_layer = [torch.cat(layer_rows, 2) for layer_rows in zip(*rows, strict=True)]  # (K, H, G, T)
    return F.lookahead_attention(per_layer, t, n_kv)


def why_not(err: Exception) -> str:
    """One line saying why a baseline cannot run on a model (its error's type and first line)."""
    lines = str(err).splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def gather_kv(keys: Tensor, values: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """Keep ``idx`` (B, Hkv, n) or one set for all heads (B, n) of keys / values (B, Hkv, T, D)."""
    if idx.dim() == 2:
        idx = idx.unsqueeze(1).expand(-1, keys.shape[1], -1)
    full = idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
    return keys.gather(2, full), values.gather(2, full)


def prune(model, obs: Observed, indices: list[Tensor | None] | Tensor):
    """A cache holding the kept tokens: per-layer indices, or one (B, n) set for all layers. A sliding-window layer
    (``obs.window_layers``) and a layer whose indices are None keep every token."""
    n = len(obs.keys)
    per_layer = indices if isinstance(indices, list) else [indices] * n
    kept = [(k, v) if i is None or layer in obs.window_layers else gather_kv(k, v, i)
            for layer, (k, v, i) in enumerate(zip(obs.keys, obs.values, per_layer, strict=True))]
    return hf.make_cache(model, [k for k, _ in kept], [v for _, v in kept])

"""Decode-time eviction: hold every layer's cache at a token budget while generating.

``DecodeEvictor`` is a context manager around generation (``hf.generate`` or any
forward passes with explicit positions). After each full-attention layer it appends the new
queries' attention rows to a window of the last W rows, and when the layer holds more
than ``budget`` tokens (or, with ``interval`` k, budget + k - 1) it keeps the top
``budget`` per KV head. Sliding-window layers are never compressed (``scdviz.evict.windows``): the evictor
keeps no state for them and leaves their cache as the model keeps it; a model whose every layer is sliding is
refused. Scores come from either
  * a DistillCachePress (per-head policy): the 5 features from the window rows, with
    each token's visibility (rows that saw it) and its true position tracked; or
  * a StudentPress (scdviz.evict.student): each token's static score computed once, when it
    arrives, from its hidden state and value, plus the age term at every cut (and, for a student
    with a window, the window term from the attention rows of its last W decode steps); the tokens
    cached before generation need their arrival scores (``prefill_scores``); or
  * an H2OPress (scdviz.evict.h2o): every token's attention summed over every query that saw it and the
    number of those queries, both carried on from the prefill (``prefill_scores``: its H2O / ObservedAttention
    scores) and added to at every step: H2O's accumulated score, nothing forgotten; or
  * any kvpress ScorerPress: ``press.score`` with the buffered hidden states and window
    rows as ``attentions`` (attention-free scorers such as Knorm ignore them). For ObservedAttention this
    is a windowed variant (the last ``window`` rows over a full prefill's visibility), not H2O. The evictor
    scores with its own copy of the press (its ``compression_ratio`` set per cut): the press given is never
    changed, so one press can serve a prefill and other runs beside.

State per layer: rows (B, H, w, Tk), hidden (B, w, d), positions (B, Hkv, Tk) absolute
token positions of the cached tokens (``prefill_positions`` for the tokens cached before
generation, e.g. the kept indices of a pruned prefill; 0..n-1 without), seen (B, Hkv, Tk) rows
that saw each token, and for a student its static scores (B, R, Tk) (and, with a window, the rows).
Needs eager (or ``hf.ROWS``) attention for attention-based scorers and students with a window.
Does not compress a prefill (press.py) nor run generation itself (scdviz.models.hf.generate).

Why not kvpress's ``DecodingPress`` (kvpress 0.5.5; tests/test_press_wrappers.py shows
the differences): its hook hands the scorer only the attention of the current forward
pass (one query row while decoding), keeps no window of past rows, no count of the rows
that saw each token and no true positions (the DistillCache features would be computed
from one row, with the cache index as position once anything was evicted), and it
empties its hidden-state buffer at every compression, so generic scorers see one hidden
state at interval 1. It counts ``compression_interval`` in forward passes since its
last compression rather than tokens above the budget, so a cache that starts above the
budget grows for ``interval`` steps before the first cut (this evictor cuts at once
and never holds more than budget + interval - 1). It also hooks through
``BasePress.__call__``, which neither holds the model's work lock (scdviz.models.hf)
nor removes the ``rotary_emb`` it sets. Rebuilding on it would mean overriding its
whole ``forward_hook``, i.e. this module again.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from scdviz.evict import features as F
from scdviz.evict import kvpress_limits, windows
from scdviz.evict.h2o import H2OPress, accumulated
from scdviz.evict.policy import gumbel_top_b, plackett_luce_logprob
from scdviz.evict.press import DistillCachePress
from scdviz.evict.student import StudentPress, window_column
from scdviz.models import hf

DECODE_WINDOW = 64  # query rows every decode-time scorer sees in the benches (the shipped policies' W)


@dataclass
class _LayerState:
    """What the evictor tracks for one layer."""

    rows: Tensor  # (B, H, w, Tk) attention of the last w queries over the cached tokens
    hidden: Tensor  # (B, w, d) normalised inputs of those queries
    positions: Tensor  # (B, Hkv, Tk) absolute position of every cached token
    seen: Tensor  # (B, Hkv, Tk) how many buffered rows could see each token
    static: Tensor | None = None  # (B, R, Tk) a student's arrival scores of the cached tokens
    total: Tensor | None = None  # (B, Hkv, Tk) H2O: attention received from every query so far (mean over the group)
    count: Tensor | None = None  # (B, Hkv, Tk) H2O: how many queries saw each token (prefill and decode)
    # a student with a window: the rows (B, H, n, Tk_then) that arrived since ``rows`` was last brought up to date,
    # merged at a cut (``merged``), so that a step appends one row instead of copying the window
    pending: list[Tensor] = field(default_factory=list)

    def merged(self, tk: int, w: int) -> Tensor:
        """``rows`` with the pending rows appended, each padded with zeros to ``tk`` tokens (the tokens that arrived
        after it), the last ``w`` kept; stored back, pending emptied."""
        if self.pending:
            parts = [self.rows, *self.pending]
            self.rows = torch.cat([torch.nn.functional.pad(p.float(), (0, tk - p.shape[-1])) for p in parts], 2)[
                :, :, -w:]
            self.pending = []
        return self.rows


@dataclass
class DecodeEvictor:
    """Keep each full-attention layer's cache at ``budget`` tokens (per KV head) during generation (sliding-window
    layers are left as the model keeps them)."""

    press: object  # a DistillCachePress (per-head policy) or a kvpress ScorerPress
    budget: int  # tokens kept per full-attention layer and KV head
    window: int = 32  # w, recent query rows kept for scoring
    interval: int = 1  # evict once the cache holds budget + interval tokens (1: hold exactly at budget)
    states: dict[int, _LayerState] = field(default_factory=dict)  # layer -> state
    evictions: int = 0  # layer-evictions performed
    score_seconds: float = 0.0  # time spent scoring (policy overhead)
    # training (DistillCache only): sample each kept set from the policy (Gumbel top-B, a Plackett-Luce
    # draw) instead of taking its top-B, and record every eviction's (position of the token being
    # decoded, log-probability of the draw with its graph) for the sequential REINFORCE estimator
    sampler: torch.Generator | None = None
    decisions: list[tuple[int, Tensor]] = field(default_factory=list)
    # the tokens cached before generation: per layer their positions (B, Hkv, n) and, for a student, its arrival
    # scores over the whole prefill (B, R, T) (Student.static; StudentPress.arrival), indexed by position
    # (an H2OPress: its prefill scores (B, Hkv, T), the mean attention over the prefill's queries); a sliding-window
    # layer's entries are never read (None will do)
    prefill_positions: list[Tensor] | None = None
    prefill_scores: list[Tensor] | None = None
    _scorer: object = field(default=None, init=False, repr=False)  # a kvpress scorer: the evictor's own copy

    @contextlib.contextmanager
    def __call__(self, model):
        """Evict inside the context; the state is reset on entry."""
        if self.budget < 1 or self.interval < 1:
            raise ValueError(f"budget and interval must be at least 1, got {self.budget} and {self.interval}")
        windows.compressed_layers(model)  # a model of sliding-window layers only is refused (and its family read)
        self.states.clear()
        self.decisions.clear()
        if self.sampler is not None and not isinstance(self.press, DistillCachePress):
            raise ValueError("sampled eviction (training) needs a DistillCache policy")
        if isinstance(self.press, DistillCachePress):
            if not self.press.policy.config.per_head:
                raise ValueError(
                    "decode-time eviction keeps a token set per layer and KV head; the global DistillCache policy "
                    "(one set for all layers) is for prefill compression only: use a per-head policy")
            if self.press.policy.config.lookahead:
                raise ValueError(
                    "decode-time eviction rescores from the window of recent attention rows; a lookahead policy also "
                    "reads continuations sampled after the prefill, which do not exist there: use a 5-feature policy")
            self.press.policy.to(hf.device_of(model))
        if isinstance(self.press, StudentPress):
            self.press.student.check_model(model)
        kvpress_limits.check(self.press, model, eager=True)  # a scorer that would rebuild its attention wrongly
        self._scorer = copy.copy(self.press)  # the compression ratio is set per cut on this copy, never on the press
        with hf.attention_hook(model, self._on_layer):
            yield self

    def _on_layer(self, module, hidden, keys, values, attn, kwargs):
        if windows.is_window(module):  # never compressed: no state, its cache as the model keeps it
            return None
        state = self._update(module.layer_idx, hidden, keys, values, attn, kwargs["position_ids"])
        if keys.shape[-2] < self.budget + self.interval:
            return None
        t0 = time.perf_counter()
        with torch.set_grad_enabled(self.sampler is not None):  # a sampled decision keeps its graph
            scores = self._scores(module, state, keys, values, kwargs)  # (B, Hkv, Tk)
        self.score_seconds += time.perf_counter() - t0
        if self.sampler is None:
            idx = scores.topk(self.budget, dim=-1).indices
        else:
            idx = gumbel_top_b(scores, self.budget, self.sampler)
            self.decisions.append((int(kwargs["position_ids"].max()), plackett_luce_logprob(scores, idx).sum()))
        idx = idx.sort(-1).values  # (B, Hkv, budget)
        self._keep(state, idx)
        self.evictions += 1
        full = idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, full), values.gather(2, full)

    def _update(
        self, layer: int, hidden: Tensor, keys: Tensor, values: Tensor, attn: Tensor | None, position_ids: Tensor
    ) -> _LayerState:
        """Append the new queries' rows, hidden states, positions, visibility (and a student's arrival scores)."""
        b, n_kv, tk, _ = keys.shape
        n_new = hidden.shape[1]
        new_pos = position_ids.view(b, 1, n_new).expand(b, n_kv, n_new).to(keys.device)
        if attn is None:
            if isinstance(self.press, DistillCachePress):
                raise ValueError("decode-time DistillCache needs eager attention: call hf.set_eager(model) first")
            if isinstance(self.press, H2OPress):
                raise ValueError("decode-time H2O accumulates every step's attention row: decode with eager attention "
                                 "or hf.ROWS")
            if isinstance(self.press, StudentPress) and self.press.student.config.window:
                raise ValueError("a student with a window reads the attention rows of the last decode steps: decode "
                                 "with eager attention or hf.ROWS")
            attn = keys.new_zeros(b, n_kv, n_new if not isinstance(self.press, StudentPress) else 0, tk).float()
        state = self.states.get(layer)
        if state is None:
            state = self._first(layer, hidden, keys, attn, tk - n_new, int(position_ids.min()))
        if state.total is not None:  # H2O: add the new rows to every token's sum and count
            group = attn.shape[1] // n_kv
            got = attn.float().sum(2).view(b, n_kv, group, tk).mean(2)  # (B, Hkv, Tk)
            steps = torch.arange(n_new, device=keys.device)
            new = (steps.view(-1, 1) >= steps.view(1, -1)).sum(0).float().view(1, 1, n_new).expand(b, n_kv, n_new)
            state.total = torch.nn.functional.pad(state.total, (0, n_new)) + got
            state.count = torch.cat([state.count + n_new, new], -1)
            state.positions = torch.cat([state.positions, new_pos], -1)
            self.states[layer] = state
            return state
        if state.static is not None:  # a student: its arrival scores and the positions (and its window's rows)
            new = self.press.student.static(layer, hidden, values[..., -n_new:, :], new_pos[:, : state.static.shape[1]])
            state.static = torch.cat([state.static, new], -1)
            state.positions = torch.cat([state.positions, new_pos], -1)
            w = self.press.student.config.window
            if w:
                state.pending.append(attn)  # merged at the next cut (_LayerState.merged), or once w are waiting
                if len(state.pending) >= w:
                    state.merged(tk, w)
            self.states[layer] = state
            return state
        rows = torch.cat([torch.nn.functional.pad(state.rows, (0, n_new)), attn.float()], dim=2)[:, :, -self.window :]
        seen = torch.cat([state.seen, torch.zeros(b, n_kv, n_new, device=keys.device)], -1)
        steps = torch.arange(n_new, device=keys.device)
        causal = (steps.view(-1, 1) >= steps.view(1, -1)).sum(0)  # rows seeing new token j
        seen[..., -n_new:] = causal.float()
        seen[..., :-n_new] += n_new
        state = _LayerState(
            rows,
            torch.cat([state.hidden, hidden], 1)[:, -self.window :],
            torch.cat([state.positions, new_pos], -1),
            seen.clamp(max=rows.shape[2]),
        )
        self.states[layer] = state
        return state

    def _first(self, layer: int, hidden: Tensor, keys: Tensor, attn: Tensor, old: int, now: int) -> _LayerState:
        """The state of a layer first seen holding ``old`` tokens cached before generation; ``now``: the position of
        the first new token (the prefill's length)."""
        b, n_kv = keys.shape[:2]
        if self.prefill_positions is not None:
            start = self.prefill_positions[layer].to(keys.device).long()
            if start.shape != (b, n_kv, old):
                raise ValueError(f"prefill_positions of layer {layer} are {tuple(start.shape)}, but the layer caches "
                                 f"{old} tokens in {n_kv} KV heads")
        else:  # positions 0..old-1
            start = torch.arange(old, device=keys.device).view(1, 1, old).expand(b, n_kv, old)
        static = None
        if isinstance(self.press, H2OPress):  # the prefill's sums: its mean attention times its visibility
            count = (now - start).float()
            total = torch.zeros(b, n_kv, old, device=keys.device)
            if old:
                if self.prefill_scores is None:
                    raise ValueError("decode-time H2O carries each token's attention from the prefill on: prefill with "
                                     "the same press inside the evictor, or give the prefill's H2O (ObservedAttention) "
                                     "scores and the cached tokens' positions (prefill_scores, prefill_positions)")
                total = self.prefill_scores[layer].to(keys.device).float().gather(2, start) * count
            return _LayerState(attn[..., :0, :old], hidden[:, :0], start, count, total=total, count=count)
        if isinstance(self.press, StudentPress):
            rows = self.press.student.weight.shape[1]
            if self.prefill_scores is not None and self.prefill_positions is not None:
                static = self.prefill_scores[layer].to(keys.device).float()[:, :rows].gather(2, start[:, :rows])
            elif layer in self.press.carried and self.press.carried[layer][0].shape == (b, n_kv, old):
                start, static = (t.to(keys.device) for t in self.press.carried[layer])  # the press's own prefill
            else:
                raise ValueError("decode-time eviction with a student scores each token when it arrives: prefill "
                                 "with the same StudentPress first, or give the prefill's arrival scores and the "
                                 "cached tokens' positions (prefill_scores, prefill_positions)")
        return _LayerState(attn[..., :0, :old], hidden[:, :0], start, torch.zeros(b, n_kv, old, device=keys.device),
                           static)

    def _scores(self, module, state: _LayerState, keys: Tensor, values: Tensor, kwargs: dict) -> Tensor:
        """Scores (B, Hkv, Tk) of the layer's cached tokens."""
        if state.static is not None:
            rows, student = state.static.shape[1], self.press.student
            now = int(state.positions.max()) + 1
            w = student.config.window
            column = window_column(state.merged(keys.shape[-2], w), keys.shape[1]) if w else None
            scores = state.static + student.dynamic(module.layer_idx, state.positions[:, :rows], now, column)
            return scores.expand(-1, keys.shape[1], -1)
        if state.total is not None:
            return accumulated(state.total, state.count)
        if isinstance(self.press, DistillCachePress):
            n_kv, group = keys.shape[1], state.rows.shape[1] // keys.shape[1]
            n_vis = state.seen.repeat_interleave(group, dim=1)  # (B, H, Tk)
            pos = state.positions.float() / state.positions.max().clamp_min(1)
            return self.press.policy(F.layer_features(state.rows, values.detach(), n_vis, pos, n_kv))
        self._scorer.compression_ratio = 1.0 - self.budget / keys.shape[-2]
        return self._scorer.score(module, state.hidden, keys, values, state.rows, kwargs)

    def _keep(self, state: _LayerState, idx: Tensor) -> None:
        """Drop evicted tokens from the layer's state; idx (B, Hkv, budget)."""
        state.positions = state.positions.gather(2, idx)
        if state.total is not None:  # H2O tracks its sums and counts only
            state.total, state.count = state.total.gather(2, idx), state.count.gather(2, idx)
            return
        if state.static is not None:  # a student tracks its scores and positions (and its window's rows) only
            state.static = state.static.gather(2, idx[:, : state.static.shape[1]])
            if not self.press.student.config.window:
                return
        else:
            state.seen = state.seen.gather(2, idx)
        group = state.rows.shape[1] // idx.shape[1]
        rows_idx = idx.repeat_interleave(group, dim=1).unsqueeze(2).expand(-1, -1, state.rows.shape[2], -1)
        state.rows = state.rows.gather(3, rows_idx)

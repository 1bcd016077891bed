"""The 5 per-token features of DistillCache, from attention over a window of recent queries.

For each cached token i (docs/design.md, DistillCache), computed from the attention probabilities of
the last W queries and the cached values:

  0  alpha    mean attention received, normalised by how many window queries see i
  1  vnorm    L2 norm of the value vector ||v_i||
  2  sigma    variance of the received attention across query heads
  3  entropy  attention-weighted entropy of the queries that attend to i:
              sum_q a_qi H_q / sum_q a_qi, with H_q the entropy of query q's row
  4  pos      position of i divided by the largest position in the cache

and, for policies that ask for it (``PolicyConfig.lookahead``), a sixth:

  5  lookahead  attention that continuations the model samples itself after the context
                pay to i (``lookahead_attention``): a forecast of the future's attention
                (what the real continuation will read), which attention history alone
                does not give (``python -m research.policy_headroom``)

Two forms: per layer and KV head (query heads grouped by the KV head they share; the
form a per-head press needs) and global (all query heads of a layer in one group,
values averaged over KV heads, then averaged over layers: one token set for all layers).

Shapes: attn (B, H, W, T) window rows; values (B, Hkv, T, D); n_vis (T,) or (B, T);
positions (B, Hkv, T) or (T,). Pure tensor maths: this module runs no model and does not
decide what to keep (scdviz.evict.policy).
"""

from __future__ import annotations

import torch
from torch import Tensor

N_FEATURES = 5  # the features as specified; a lookahead policy reads one more
NAMES = ("alpha", "vnorm", "sigma", "entropy", "pos")
LOOKAHEAD = "lookahead"
POS = 4  # the position column (not standardised by the policy)
_EPS = 1e-12


def window_rows(attn: Tensor, window: int) -> Tensor:
    """The last ``window`` query rows of attention (B, H, T_q, T) -> (B, H, W, T)."""
    return attn[..., -window:, :]


def prefill_visibility(n_tokens: int, window: int, device=None) -> Tensor:
    """How many of the last ``window`` queries of a causal prefill see token i: (T,)."""
    i = torch.arange(n_tokens, device=device)
    return torch.clamp(n_tokens - i, max=min(window, n_tokens)).float()


def layer_features(attn: Tensor, values: Tensor, n_vis: Tensor, positions: Tensor, groups: int) -> Tensor:
    """Features of one layer with the query heads split into ``groups`` groups.

    attn (B, H, W, T) window rows; values (B, Hkv, T, D); n_vis (T,) or (B, T) queries
    that can see each token; positions (B, G, T) or (T,) normalised to [0, 1].
    groups = Hkv gives the per-KV-head form; groups = 1 the layer's global form (value
    norms averaged over KV heads). Returns (B, G, T, 5).
    """
    b, h, _, t = attn.shape
    attn = attn.float()
    n_vis = n_vis.float().reshape(-1, 1, t) if n_vis.dim() == 2 else n_vis.float()
    recv = attn.sum(2) / n_vis.clamp_min(1.0)  # (B, H, T)
    grouped = recv.view(b, groups, h // groups, t)
    alpha = grouped.mean(2)
    sigma = grouped.var(2, unbiased=False)
    row_entropy = -(attn * (attn + _EPS).log()).sum(-1)  # (B, H, W)
    mass = attn.sum(2)  # (B, H, T)
    weighted = (attn * row_entropy.unsqueeze(-1)).sum(2) / mass.clamp_min(_EPS)  # (B, H, T)
    entropy = weighted.view(b, groups, h // groups, t).mean(2)
    vnorm = values.float().norm(dim=-1)  # (B, Hkv, T)
    vnorm = vnorm.view(b, groups, -1, t).mean(2)
    pos = positions.float().expand(b, groups, t)
    return torch.stack([alpha, vnorm, sigma, entropy, pos], dim=-1)


def prefill_layer_features(attn: Tensor, values: Tensor, window: int, groups: int) -> Tensor:
    """``layer_features`` after a causal prefill (B, H, T, T): window rows, visibility, positions."""
    t = attn.shape[-1]
    w = min(window, attn.shape[-2])
    positions = torch.arange(t, dtype=torch.float32, device=attn.device) / max(t - 1, 1)
    return layer_features(window_rows(attn, w), values, prefill_visibility(t, w, attn.device), positions, groups)


def global_features(per_layer: list[Tensor]) -> Tensor:
    """Average of the layers' global forms [(B, 1, T, 5)] -> (B, T, 5)."""
    return torch.stack(per_layer, 0).mean(0)[:, 0]


def future_attention(attn: list[Tensor], n_context: int, n_kv: int) -> tuple[Tensor, Tensor]:
    """The future's attention: attention that *later* tokens pay to each context token.

    attn: per layer (B, H, n, n_context + n), the rows of n continuation tokens run over the
    full cache (a teacher's view, known only in training). Returns the per-KV-head form
    (L, B, Hkv, T), the group's query heads summed and the rows averaged, and the global
    form (B, T), averaged over layers and heads, each laid out like the features.
    """
    per_layer = []
    for a in attn:
        b, h, _, _ = a.shape
        recv = a[..., :n_context].float().mean(2)  # (B, H, T)
        per_layer.append(recv.view(b, n_kv, h // n_kv, n_context).sum(2))
    head = torch.stack(per_layer, 0)
    return head, head.mean((0, 2))


def lookahead_attention(attn: list[Tensor], n_context: int, n_kv: int) -> Tensor:
    """The lookahead feature (L, 1, Hkv, T) from the attention rows of K sampled continuations.

    attn: per layer (K, H, G, >= n_context), the G sampled tokens of each of K samples over
    the full cache. Like ``future_attention``'s per-KV-head form, averaged over the samples.
    """
    return future_attention(attn, n_context, n_kv)[0].mean(1, keepdim=True)

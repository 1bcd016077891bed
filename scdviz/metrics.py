"""Quality metrics between a reference (oracle / full cache) and a method's logits.

Pure tensor maths on logits (..., V); no models. Used by drift, SCD and eviction alike.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch import Tensor


def kl_per_token(ref_logits: Tensor, logits: Tensor) -> Tensor:
    """KL(P_ref || P) per position, (..., V) -> (...), in nats, computed in fp32."""
    ref = torch.log_softmax(ref_logits.float(), dim=-1)
    got = torch.log_softmax(logits.float(), dim=-1)
    return (ref.exp() * (ref - got)).sum(-1).clamp_min(0.0)


def top1_agreement(ref_logits: Tensor, logits: Tensor) -> Tensor:
    """1.0 where the argmax tokens agree, else 0.0; (..., V) -> (...)."""
    return (ref_logits.argmax(-1) == logits.argmax(-1)).float()


def nll_per_token(logits: Tensor, targets: Tensor) -> Tensor:
    """Negative log-likelihood of ``targets`` (...) under ``logits`` (..., V)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -logp.gather(-1, targets.to(logp.device).unsqueeze(-1)).squeeze(-1)  # token ids may come from the host


def perplexity(nll: Tensor | list[float]) -> float:
    """exp(mean NLL) over all given tokens."""
    nll = torch.as_tensor(nll, dtype=torch.float64, device=nll.device if isinstance(nll, Tensor) else "cpu")
    return float(math.exp(nll.mean())) if nll.numel() else float("nan")


def token_f1(pred: list[int] | list[str], ref: list[int] | list[str]) -> float:
    """SQuAD-style bag-of-tokens F1 between two sequences."""
    if not pred and not ref:
        return 1.0
    common = Counter(pred) & Counter(ref)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean."""
    t = torch.as_tensor(values, dtype=torch.float64, device="cpu")  # a list of Python floats
    if t.numel() < 2:
        return float(t.mean()) if t.numel() else float("nan"), float("nan")
    return float(t.mean()), float(t.std(unbiased=True) / math.sqrt(t.numel()))


def _resamples(n: int, clusters, n_boot: int, seed: int) -> tuple[Tensor, Tensor]:
    """Bootstrap weights (n_boot, n): how often each item is drawn, and the items drawn per resample.

    Without ``clusters`` items are drawn independently; with them (one label per item) whole
    clusters are drawn, with replacement, as many as there are, each bringing all its items:
    the cluster bootstrap, for items that are correlated within a cluster (windows of one passage).
    """
    gen = torch.Generator().manual_seed(seed)
    if clusters is None:
        labels = torch.arange(n)
    else:
        if len(clusters) != n:
            raise ValueError(f"{len(clusters)} cluster labels for {n} items")
        names = {c: i for i, c in enumerate(dict.fromkeys(clusters))}
        labels = torch.tensor([names[c] for c in clusters])
    n_clusters = int(labels.max()) + 1
    drawn = torch.zeros(n_boot, n_clusters, dtype=torch.float64)
    drawn.scatter_add_(1, torch.randint(0, n_clusters, (n_boot, n_clusters), generator=gen),
                       torch.ones(n_boot, n_clusters, dtype=torch.float64))
    weights = drawn[:, labels]  # (n_boot, n): each item counts as often as its cluster was drawn
    return weights, weights.sum(1)


def paired_bootstrap(a: list[float], b: list[float], n_boot: int = 2000, seed: int = 0, level: float = 0.95,
                     clusters: list | None = None) -> dict:
    """Mean of b − a over paired items with a percentile bootstrap interval (items resampled together).

    Also the ratio of means mean(b) / mean(a) with its interval from the same resamples.
    clusters: one label per item (e.g. the passage a window starts in); resamples then draw whole
    clusters (``_resamples``), and ``clusters`` in the result says how many there were.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired bootstrap needs two equally long non-empty lists, got {len(a)} and {len(b)}")
    x = torch.tensor(a, dtype=torch.float64)
    y = torch.tensor(b, dtype=torch.float64)
    w, count = _resamples(len(a), clusters, n_boot, seed)
    mx, my = (w @ x) / count, (w @ y) / count
    diff = my - mx
    ratio = my / mx.clamp_min(1e-30)
    lo, hi = (1 - level) / 2, 1 - (1 - level) / 2
    q = torch.tensor([lo, hi], dtype=torch.float64)
    return {"diff": float((y - x).mean()), "diff_ci": [float(v) for v in diff.quantile(q)],
            "ratio": float(y.mean() / x.mean().clamp_min(1e-30)), "ratio_ci": [float(v) for v in ratio.quantile(q)],
            "n": len(a), "clusters": len(set(clusters)) if clusters is not None else len(a)}


def bootstrap_mean(values: list[float], n_boot: int = 2000, seed: int = 0, level: float = 0.95,
                   clusters: list | None = None) -> dict:
    """Mean with a percentile bootstrap interval over the items (over whole ``clusters`` when given)."""
    if not values:
        raise ValueError("bootstrap of an empty list")
    x = torch.tensor(values, dtype=torch.float64)
    w, count = _resamples(len(values), clusters, n_boot, seed)
    q = torch.tensor([(1 - level) / 2, 1 - (1 - level) / 2], dtype=torch.float64)
    return {"mean": float(x.mean()), "ci": [float(v) for v in ((w @ x) / count).quantile(q)], "n": len(values)}

"""Can a per-token map from producer features predict the consumer's K and V better than the REUSE code?

    python -m research.aligner_features [CONSUMER] [LAYERS]     # default builtin:austen-before 8,14,20,23,26

Paired prefills of 3 calibration windows per shipped domain (255 tokens, token 0 left out). For
each layer and feature set, a ridge map (strength 1e-3, 1e-2 or 0.1 of the mean input eigenvalue,
the best kept) from the features to the consumer's pre-RoPE K and V, fitted without one domain and
scored on it (leave-one-domain-out); prints the relative squared error. Feature sets: the
producer's K, V (the REUSE code's input); its normalised H_in; H_in with the previous token's, an
exponential moving average (0.9) or the causal running mean of H_in (context); H_in with K, V; K, V
with the previous token's K, V, with the previous layer's K, V (the rows a consumer also receives), and
with both those and the running mean of K, V.
"""

from __future__ import annotations

import argparse

import torch

from scdviz import data
from scdviz.models.pair import load_pair
from scdviz.scd import transfer

KINDS = ("code", "h", "h+prev", "h+ema.9", "h+cummean", "h+kv", "h+kv+cummean", "kv+cummeankv", "kv+prevtok",
         "kv+prevlayer", "kv+prevlayer+cummeankv")


def ema(z: torch.Tensor, decay: float) -> torch.Tensor:
    """Causal (exponentially weighted) mean of the rows up to each row; decay 1 is the running mean."""
    out, acc, n = torch.empty_like(z), torch.zeros(z.shape[1]), 0.0
    for t in range(z.shape[0]):
        acc, n = decay * acc + z[t], decay * n + 1
        out[t] = acc / n
    return out


def features(row, kind: str, mean, std) -> torch.Tensor:
    _, hp, kp, vp, _, below = row
    z, kv = (hp - mean) / std, torch.cat([kp, vp], 1)
    return {"code": lambda: kv, "h": lambda: z, "h+prev": lambda: torch.cat([z, torch.cat([z[:1], z[:-1]])], 1),
            "h+ema.9": lambda: torch.cat([z, ema(z, 0.9)], 1), "h+cummean": lambda: torch.cat([z, ema(z, 1.0)], 1),
            "h+kv": lambda: torch.cat([z, kv], 1), "h+kv+cummean": lambda: torch.cat([z, kv, ema(z, 1.0)], 1),
            "kv+cummeankv": lambda: torch.cat([kv, ema(kv, 1.0)], 1),
            "kv+prevtok": lambda: torch.cat([kv, torch.cat([kv[:1], kv[:-1]])], 1),
            "kv+prevlayer": lambda: torch.cat([kv, below], 1),
            "kv+prevlayer+cummeankv": lambda: torch.cat([kv, below, ema(kv, 1.0)], 1)}[kind]()


def ridge(x, y, lam):
    mx, my = x.mean(0), y.mean(0)
    xc = (x - mx).double()
    g = xc.T @ xc
    w = torch.linalg.solve(g + lam * g.diagonal().mean() * torch.eye(g.shape[0], dtype=torch.float64),
                           xc.T @ (y - my).double())
    return mx, my, w


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m research.aligner_features", description=__doc__.splitlines()[0])
    ap.add_argument("consumer", nargs="?", default="builtin:austen-before", help="the consumer (default: %(default)s)")
    ap.add_argument("layers", nargs="?", default="8,14,20,23,26", help="comma-separated layers (default: %(default)s)")
    args = ap.parse_args(argv)
    consumer, layers = args.consumer, [int(x) for x in args.layers.split(",")]
    pair = load_pair("builtin:smollm2-135m", consumer)
    domains = data.corpora()
    rows = {layer: [] for layer in layers}
    for fold, domain in enumerate(domains):
        for window in data.token_windows(pair.tokenizer, data.passages(domain, "calib"), 256, 3):
            ids = torch.tensor([window[:255]])
            p, c = transfer.producer_state(pair.producer, ids), transfer.producer_state(pair.consumer, ids)
            for layer in layers:
                rows[layer].append((fold, p.h_in[layer][1:], p.keys_pre[layer][1:], p.values[layer][1:],
                                    torch.cat([c.keys_pre[layer][1:], c.values[layer][1:]], 1),
                                    torch.cat([p.keys_pre[layer - 1][1:], p.values[layer - 1][1:]], 1)))
    for layer in layers:
        rs = rows[layer]
        allh = torch.cat([r[1] for r in rs])
        mean, std = allh.mean(0), allh.std(0).clamp_min(1e-6)
        out = {}
        for kind in KINDS:
            feats = [features(r, kind, mean, std) for r in rs]
            errs = []
            for lam in (1e-3, 1e-2, 1e-1):
                num = den = 0.0
                for fold in range(len(domains)):
                    tr = [i for i, r in enumerate(rs) if r[0] != fold]
                    te = [i for i, r in enumerate(rs) if r[0] == fold]
                    mx, my, w = ridge(torch.cat([feats[i] for i in tr]), torch.cat([rs[i][4] for i in tr]), lam)
                    yt = torch.cat([rs[i][4] for i in te])
                    pred = ((torch.cat([feats[i] for i in te]) - mx).double() @ w + my).float()
                    num += float(((pred - yt) ** 2).sum())
                    den += float(((yt - yt.mean(0)) ** 2).sum())
                errs.append(num / den)
            out[kind] = min(errs)
        print(layer, " ".join(f"{k}={v:.4f}" for k, v in out.items()), flush=True)


if __name__ == "__main__":
    main()

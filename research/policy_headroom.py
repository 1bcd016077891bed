"""Where a learned eviction policy's signal could come from, measured on validation only.

    SCDVIZ_THREADS=1 python -m research.policy_headroom [--out headroom.json]

On the shipped policies' own data (16 train contexts of jargon + bible, 6 validation
contexts from their calib splits, 512 tokens + 24 teacher-forced, kept 25 % and 12.5 %,
per layer and KV head) it prints the validation KL(full ‖ pruned) of top-B by:
  * single attention statistics: alpha over the last 64 queries (the 5-feature policy's
    heuristic), over all queries (H2O), the last query (TOVA-like), the last 8, the max
    over 64 rows, and the key norm;
  * the future attention itself (the attention the continuation pays each token over
    the full cache): an oracle nobody has at inference, the bound for a forecaster;
  * an MLP (the policy's shape) trained to imitate alpha's or the future's top-B ranking
    (Plackett-Luce likelihood, 600 steps) from the 5 DistillCache features or those
    plus the five statistics above.
It answers whether attention-history features can forecast what the future reads.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from scdviz import data
from scdviz.evict import features as F
from scdviz.evict import train as trainer
from scdviz.evict.policy import keep_count
from scdviz.models import hf
from scdviz.models.pair import choose_threads, load_model

STATS = ("alpha, all rows (H2O)", "last row (TOVA-like)", "alpha, last 8 rows", "max over 64 rows", "key norm")


def statistics(model, ids: torch.Tensor) -> torch.Tensor:
    """(L, Hkv, T, 5) extra per-token statistics from one eager prefill of ``ids`` (1, T)."""
    n_heads, n_kv, _ = hf.attn_heads(model)
    group = n_heads // n_kv
    with hf.eager(model):
        trace = hf.forward(model, ids, attentions=True)
    t = ids.shape[1]
    visible = torch.arange(t, 0, -1, device=ids.device).float()
    out = []

    def per_kv(x):  # (1, H, T) -> (1, Hkv, T): the mean over the query heads sharing a KV head
        return x.view(1, n_kv, group, t).mean(2)

    for layer, attn in enumerate(trace.attn):  # (1, H, T, T)
        keys, _ = hf.layer_kv(trace.cache, layer)
        out.append(torch.stack([per_kv(attn.sum(2) / visible), per_kv(attn[:, :, -1]),
                                per_kv(attn[:, :, -8:].sum(2) / visible.clamp(max=8)), per_kv(attn[:, :, -64:].amax(2)),
                                keys.float().norm(dim=-1)], -1))
    return torch.stack(out, 0)[:, 0]


def inputs(sample, extra: bool) -> torch.Tensor:
    """Standardised features (R, T, k): the 5 DistillCache ones, plus the statistics when ``extra``."""
    base = sample.obs.head_features[:, 0]
    x = torch.cat([base[..., :4], sample.stats], -1).float().clone()
    for col in (0, 1, 2, 4, 5, 6, 7):  # positive, heavy-tailed: logged (entropy and key norm as they are)
        x[..., col] = (x[..., col] + 1e-10).log()
    x = (x - x.mean(-2, keepdim=True)) / (x.std(-2, keepdim=True) + 1e-6)
    x = torch.cat([x, base[..., 4:5]], -1)  # position unscaled, as in the policy
    cols = list(range(10)) if extra else [0, 1, 2, 3, 9]
    return x[..., cols].flatten(0, 1)


def future_rows(model, sample: trainer.Sample) -> torch.Tensor:
    """(L * Hkv, T) the attention the sample's teacher-forced tail pays each context token over the full cache
    (the oracle: what the future reads), laid out like ``train.rows`` of a per-head policy."""
    n = sample.obs.n_tokens
    with torch.no_grad(), hf.eager(model):
        trace = hf.forward(model, sample.cont, cache=hf.make_cache(model, sample.obs.keys, sample.obs.values),
                           positions=torch.arange(n, n + sample.cont.shape[1]).unsqueeze(0), attentions=True)
    return F.future_attention(trace.attn, n, hf.attn_heads(model)[1])[0][:, 0].flatten(0, 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m research.policy_headroom", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results (JSON) here")
    args = ap.parse_args(argv)
    choose_threads()
    torch.manual_seed(0)
    model, tokenizer = load_model("builtin:smollm2-135m")
    cfg = trainer.TrainConfig(out="unused", contexts=16, val_contexts=6)
    cfg.policy.window = 64
    t0 = time.time()
    splits = {"train": trainer.prepare(model, tokenizer, cfg, "train", 16),
              "calib": trainer.prepare(model, tokenizer, cfg, "calib", 6)}
    for samples in splits.values():
        for sample in samples:
            sample.future = future_rows(model, sample)
    for split, samples in splits.items():  # the same windows prepare cut
        per = -(-len(samples) // len(cfg.corpora))
        length = cfg.context_len + cfg.cont_len
        windows = [w for c in cfg.corpora
                   for w in data.token_windows(tokenizer, data.load_split(c, split), length, per)]
        for sample, window in zip(samples, windows, strict=False):
            sample.stats = statistics(model, hf.ids_tensor(window)[:, : cfg.context_len])
    train, val = splits["train"], splits["calib"]
    print(f"prepared in {time.time() - t0:.0f} s")

    def val_kl(scorer) -> float:
        return trainer.validate(model, scorer, True, val, cfg.keeps)

    res = {"alpha, last 64 rows (the policy's heuristic)": val_kl(lambda s: trainer.rows_of_feature(s.obs, True, 0))}
    for i, name in enumerate(STATS):
        res[name] = val_kl(lambda s, i=i: s.stats[..., i].flatten(0, 1))
    res["future attention (oracle)"] = val_kl(lambda s: s.future)
    for extra in (False, True):
        for target in ("alpha", "future"):
            torch.manual_seed(0)
            k = 10 if extra else 5
            mlp = torch.nn.Sequential(torch.nn.Linear(k, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                      torch.nn.Linear(32, 1))
            opt = torch.optim.Adam(mlp.parameters(), lr=3e-3)
            xs = [inputs(s, extra) for s in train]
            ys = [trainer.rows_of_feature(s.obs, True, 0) if target == "alpha" else s.future for s in train]
            for step in range(600):
                i, n_keep = step % len(train), keep_count(cfg.context_len, cfg.keeps[step % len(cfg.keeps)])
                loss = -trainer.plackett_luce_logprob(mlp(xs[i]).squeeze(-1),
                                                      ys[i].topk(n_keep, -1).indices).mean() / n_keep
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                res[f"MLP on {'10' if extra else 'the 5'} features imitating {target}"] = val_kl(
                    lambda s, m=mlp, e=extra: m(inputs(s, e)).squeeze(-1))
    print(f"{'top-B by':55} {'val KL':>8}")
    for name, kl in res.items():
        print(f"{name:55} {kl:8.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({k: round(v, 5) for k, v in res.items()}, f, indent=1)


if __name__ == "__main__":
    main()

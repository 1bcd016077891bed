"""Is the lookahead policy's lead over H2O its learning, its sampled continuations, or its horizon? (dev slice)

    SCDVIZ_THREADS=1 python -m research.lookahead_matched [--per-domain 4] [--seeds 0 1 2] [--out FILE.json]

The headline policy (``lookahead-policy``: W = 512, K = 8 continuations of G = 40
tokens sampled from the model after the context, a prior of w x lookahead + (1 - w) x alpha, w = 0.5
for this policy, plus a learned MLP correction) is compared, on the same contexts and the same
sampled continuations, with what costs the same compute but learns nothing:

  * its prior alone (the MLP removed), and the lookahead feature alone;
  * H2O (kvpress's ObservedAttention) and SnapKV, each as kvpress scores them, and each *given the
    same samples*: H2O's running mean of attention over every row that sees a token with the G
    sampled rows added (n_i H2O_i + G look_i / group) / (n_i + G), and SnapKV's recipe (window
    attention, average-pooled over 5 tokens) on the sampled rows instead of the last prompt rows.

Each at 25 % and 12.5 % kept, one token set per layer and KV head, scored on two horizons after 16
unscored tokens: the first 24 continuation tokens (the length the policy was validated on, so
G = 40 = 16 + 24) and 128 (G fixed), for 3 sampling seeds. Contexts: ``--per-domain`` windows of
512 + 16 + 128 tokens spread through the **dev** slice of each shipped eval split (``scdviz.data``);
the test slice is never read. Writes a record (kind "evict", one row per horizon, seed, budget and
method, with per-context KL and passages).
"""

from __future__ import annotations

import argparse
import time

import torch
from kvpress import ObservedAttentionPress, SnapKVPress

from scdviz import data, metrics, records
from scdviz.evict import bench
from scdviz.evict.context import observe, prune
from scdviz.evict.policy import N_FEATURES, keep_count, lookahead_prior
from scdviz.models import hf
from scdviz.models.pair import choose_threads, load_model

DOMAINS = ("austen", "bible", "gcide", "handbook", "jargon", "manpages")
CONTEXT, QUESTION, HORIZONS, KEEPS = 512, 16, (24, 128), (0.25, 0.125)
POLICY = "lookahead-policy"


def scorers(obs, policy, group: int) -> dict[str, torch.Tensor]:
    """Scores (L, Hkv, T) of every compared method on one observation (with the lookahead feature)."""
    head = obs.head_features[:, 0]  # (L, Hkv, T, 6)
    look = head[..., N_FEATURES]
    h2o = torch.stack(obs.scores[("H2O", KEEPS[0])], 0)[:, 0]
    snap = torch.stack(obs.scores[("SnapKV", KEEPS[0])], 0)[:, 0]
    t = h2o.shape[-1]
    seen = torch.arange(t, 0, -1, dtype=h2o.dtype, device=h2o.device)  # rows of the prefill that see token i
    g = policy.config.lookahead
    pooled = torch.nn.functional.avg_pool1d(look.flatten(0, 1).unsqueeze(1).float(), 5, 1, 2).squeeze(1)
    with torch.no_grad():
        learned = policy(obs.head_features)[:, 0]
    return {POLICY: learned,
            "its prior alone (no MLP)": lookahead_prior(head, policy.config.lookahead_prior),
            "lookahead feature alone": look,
            "H2O (ObservedAttention)": h2o,
            "H2O given the samples": (seen * h2o + g * look / group) / (seen + g),
            "SnapKV": snap,
            "SnapKV on the sampled rows": pooled.view_as(look)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m research.lookahead_matched", description=__doc__.splitlines()[0])
    ap.add_argument("--per-domain", type=int, default=4, help="dev contexts per domain")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of the sampled continuations")
    ap.add_argument("--out", default="lookahead_matched.json", help="the record (JSON)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print(f"torch threads: {choose_threads()}")
    model, tokenizer = load_model("builtin:smollm2-135m")
    policy = bench.load_policies(())[POLICY].to(hf.device_of(model))
    window, g, k = policy.config.observation
    heads, n_kv, _ = hf.attn_heads(model)
    length = CONTEXT + QUESTION + max(HORIZONS)
    contexts = [w for d in DOMAINS for w in data.eval_windows(tokenizer, d, "dev", length, args.per_domain)]
    kl: dict[tuple, list[float]] = {}
    for n, win in enumerate(contexts):
        ids = hf.ids_tensor(win.ids, hf.device_of(model))
        ctx, tail = ids[:, :CONTEXT], ids[:, CONTEXT:]
        for seed in args.seeds:
            with hf.eager(model):
                obs = observe(model, ctx, window, {"H2O": ObservedAttentionPress(), "SnapKV": SnapKVPress()},
                              (KEEPS[0],), lookahead=(g, k), seed=seed)
            with hf.attention(model, "sdpa"):
                if seed == args.seeds[0]:
                    ref = hf.continue_logits(model, hf.make_cache(model, obs.keys, obs.values), tail, CONTEXT)[0]
                for name, score in scorers(obs, policy, heads // n_kv).items():
                    for keep in KEEPS:
                        idx = list(score.topk(keep_count(CONTEXT, keep), dim=-1).indices.unsqueeze(1).unbind(0))
                        logits = hf.continue_logits(model, prune(model, obs, idx), tail, CONTEXT)[0]
                        per_token = metrics.kl_per_token(ref[QUESTION:], logits[QUESTION:])
                        for h in HORIZONS:
                            kl.setdefault((h, seed, keep, name), []).append(float(per_token[:h].mean()))
        print(f"context {n + 1}/{len(contexts)} ({win.cluster}) done, {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for (h, seed, keep, name), values in kl.items():
        mean, se = metrics.mean_se(values)
        rows.append({"model": "builtin:smollm2-135m", "mode": f"lookahead study, {h} scored, seed {seed}",
                     "horizon": h, "sampling_seed": seed, "method": name, "keep": f"{keep:g}",
                     "kl": round(mean, 5), "kl_se": round(se, 5), "kl_per_context": [round(v, 6) for v in values],
                     "baseline": name != POLICY, "chosen_on_validation": name == POLICY,
                     "n_contexts": len(values), "domains": [w.domain for w in contexts],
                     "passages": [w.cluster for w in contexts]})
    settings = {"research": "lookahead_matched", "slice": "dev", "per_domain": args.per_domain, "seeds": args.seeds,
                "context_len": CONTEXT, "question_len": QUESTION, "horizons": list(HORIZONS), "keeps": list(KEEPS),
                "policy": POLICY, "lookahead": [g, k]}
    records.write(records.make("evict", settings, args.seeds[0], rows, str(hf.device_of(model)),
                               time.perf_counter() - t0), args.out)
    for h in HORIZONS:
        for keep in KEEPS:
            base = [kl[(h, s, keep, "H2O (ObservedAttention)")] for s in args.seeds]
            print(f"\n{h} scored tokens, {keep:g} kept: KL per seed, and / H2O (seed {args.seeds[0]}, cluster CI)")
            for name in dict.fromkeys(r["method"] for r in rows):
                vals = [kl[(h, s, keep, name)] for s in args.seeds]
                boot = metrics.paired_bootstrap(base[0], vals[0], clusters=[w.cluster for w in contexts])
                print(f"  {name:32} " + " ".join(f"{sum(v) / len(v):.4f}" for v in vals)
                      + f"   {boot['ratio']:.2f} [{boot['ratio_ci'][0]:.2f}, {boot['ratio_ci'][1]:.2f}]")
    print(f"wrote {args.out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()

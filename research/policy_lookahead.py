"""Does the lookahead feature carry the future's attention? Measured on validation only.

    SCDVIZ_THREADS=1 python -m research.policy_lookahead [--per-domain 4] [--question 16] [--tokens 16 40]
                          [--samples 4 8] [--policies FILE ...] [--out F.json]

On the calib (validation) split of all six shipped domains (``--per-domain`` windows each:
512 context tokens, then ``--question`` unscored tokens and 24 scored ones teacher-forced, the
tail ``bench evict`` and ``train-policy`` score), kept 25 % and 12.5 %, one token set per layer
and KV head, it prints the validation KL(full ‖ pruned) of top-B by
  * H2O's score (kvpress's ObservedAttention, alpha over all queries) and alpha over the
    last 64 queries (the 5-feature policy's heuristic);
  * the lookahead feature alone: the attention that K continuations of G tokens, sampled from
    the model itself after the context, pay to each token
    (``scdviz.evict.context.observe(lookahead=(G, K))``), for each G of ``--tokens`` and K of ``--samples``;
  * the lookahead mixed with alpha (each normalised to sum 1 per row), weight 0.5 / 0.75,
    with alpha over the last 64 queries (a W = 64 policy's prior) and over all 512 (W = 512's,
    H2O's score up to kvpress's normalisation);
  * the future attention itself (the true continuation's, an oracle nobody has);
  * any policy files given (``--policies``), e.g. a lookahead policy from ``train-policy --lookahead 16``,
    each on the features its own (W, G, K) observes;
with the paired-bootstrap ratio to H2O (95 % interval over the contexts) and the share of
contexts where it beats H2O; then each scorer's mean on the training domains' contexts
alone. The eval split is never read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from kvpress import ObservedAttentionPress

from scdviz import data, metrics
from scdviz.evict import features as F
from scdviz.evict import train as trainer
from scdviz.evict.context import observe
from scdviz.evict.policy import Policy, lookahead_prior
from scdviz.models import hf
from scdviz.models.pair import choose_threads, load_model

DOMAINS = ("jargon", "bible", "austen", "gcide", "handbook", "manpages")
CONTEXT, CONT = 512, 24


def prepare(model, tokenizer, per_domain: int, question: int,
            views: list[tuple[int, int, int]]) -> list[trainer.Sample]:
    """Validation samples with H2O's scores and the true future's attention; ``sample.views`` maps
    each observation (W, G, K) of ``views`` to its (head, global) features; the first also keeps
    the cache (``sample.obs``)."""
    samples = []
    n_kv = hf.attn_heads(model)[1]
    for domain in DOMAINS:
        for window in data.token_windows(tokenizer, data.load_split(domain, "calib"), CONTEXT + question + CONT,
                                         per_domain):
            ids = hf.ids_tensor(window)
            (w, g, k), seen = views[0], {}
            obs = observe(model, ids[:, :CONTEXT], w, {"H2O": ObservedAttentionPress()}, (0.5,), lookahead=(g, k))
            seen[views[0]] = (obs.head_features, obs.global_features)
            for w, g, k in views[1:]:
                other = observe(model, ids[:, :CONTEXT], w, lookahead=(g, k))
                seen[(w, g, k)] = (other.head_features, other.global_features)
            cont = ids[:, CONTEXT:]
            trace = hf.forward(model, cont, cache=hf.make_cache(model, obs.keys, obs.values),
                               positions=torch.arange(CONTEXT, CONTEXT + cont.shape[1]).unsqueeze(0), attentions=True)
            future = F.future_attention(trace.attn, CONTEXT, n_kv)
            sample = trainer.Sample(obs, cont, trace.logits[0, -CONT:])
            sample.domain, sample.views, sample.future = domain, seen, future
            samples.append(sample)
            print(f"  {domain}: context {len(samples)} prepared", flush=True)
    return samples


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m research.policy_lookahead", description=__doc__.splitlines()[0])
    ap.add_argument("--per-domain", type=int, default=4, help="validation windows per domain")
    ap.add_argument("--question", type=int, default=16, help="unscored tokens between context and scored tail")
    ap.add_argument("--tokens", nargs="+", type=int, default=[16], help="G values of the lookahead")
    ap.add_argument("--samples", nargs="+", type=int, default=[4], help="K values of the lookahead")
    ap.add_argument("--policies", nargs="*", default=[], help="policy files to score beside the heuristics")
    ap.add_argument("--out", default=None, help="write every per-context KL (JSON) here")
    args = ap.parse_args(argv)
    choose_threads()
    model, tokenizer = load_model("builtin:smollm2-135m")
    policies = {f"policy {Path(p).parent.name}/{Path(p).name}": Policy.load(p).to(hf.device_of(model))
                for p in args.policies}
    looks = [(g, k) for g in args.tokens for k in args.samples]
    views = [(64, g, k) for g, k in looks] + [(CONTEXT, 0, 0)]
    views += [p.config.observation for p in policies.values() if p.config.observation not in views]
    with hf.eager(model):
        samples = prepare(model, tokenizer, args.per_domain, args.question, views)
        keeps = (0.25, 0.125)

        def alpha(s, window):
            """Alpha over the last ``window`` queries (L, Hkv, T), from any view observed with that window."""
            return next(head for (w, _, _), (head, _) in s.views.items() if w == window)[:, 0, ..., 0]

        def mixed(g, k, alpha_window, lam):
            """The W = alpha_window lookahead policies' prior (its log: the same top-B as the mix)."""
            def score(s):
                feats = s.views[(64, g, k)][0][:, 0].clone()
                feats[..., 0] = alpha(s, alpha_window)
                return lookahead_prior(feats, lam).flatten(0, 1)
            return score

        def of_policy(p):
            def score(s):
                head, glob = s.views[p.config.observation]
                return p(head[:, 0]).flatten(0, 1) if p.config.per_head else p(glob)
            return score

        scorers = {"H2O (ObservedAttention)": lambda s: torch.stack(s.obs.scores[("H2O", 0.5)], 0)[:, 0].flatten(0, 1),
                   "alpha, last 64 rows": lambda s: alpha(s, 64).flatten(0, 1),
                   f"alpha, all {CONTEXT} rows": lambda s: alpha(s, CONTEXT).flatten(0, 1)}
        for g, k in looks:
            scorers[f"lookahead (G = {g}, K = {k})"] = (
                lambda s, g=g, k=k: s.views[(64, g, k)][0][:, 0, ..., 5].flatten(0, 1))
            for alpha_window in (64, CONTEXT):
                for lam in (0.5, 0.75):
                    scorers[f"{lam:g} look(G={g},K={k}) + {1 - lam:g} alpha({alpha_window})"] = mixed(
                        g, k, alpha_window, lam)
        scorers["true future attention (oracle)"] = lambda s: s.future[0][:, 0].flatten(0, 1)
        per_head = {name: True for name in scorers}
        for name, policy in policies.items():
            scorers[name], per_head[name] = of_policy(policy), policy.config.per_head
        kls = {name: trainer.validation_kls(model, fn, per_head[name], samples, keeps) for name, fn in scorers.items()}
    base = kls["H2O (ObservedAttention)"]
    print(f"\n{len(samples)} validation contexts ({args.per_domain} per domain, calib splits; "
          f"{CONTEXT} context tokens, {args.question} unscored, {CONT} scored)")
    print(f"{'top-B by':44} {'kept':>6} {'val KL':>8} {'/ H2O [95% CI]':>24} {'beats H2O':>10}")
    for name, vals in kls.items():
        for j, keep in enumerate(keeps):
            a, b = base[j::2], vals[j::2]
            boot = metrics.paired_bootstrap(a, b)
            wins = sum(y < x for x, y in zip(a, b, strict=True)) / len(a)
            ci = f"{boot['ratio']:.3f} [{boot['ratio_ci'][0]:.3f}, {boot['ratio_ci'][1]:.3f}]"
            print(f"{name:44} {keep:6g} {sum(b) / len(b):8.4f} {ci:>24} {wins:10.2f}")
    train = [i for i, smp in enumerate(samples) if smp.domain in ("jargon", "bible")]  # the policies' own domains
    print(f"\non the training domains' calib text only (jargon, bible; {len(train)} contexts), mean over both budgets:")
    for name, vals in kls.items():
        print(f"{name:44} {sum(vals[2 * i] + vals[2 * i + 1] for i in train) / (2 * len(train)):8.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"domains": [s.domain for s in samples], "keeps": keeps, "kl": kls}))


if __name__ == "__main__":
    main()

"""Does the lookahead feature carry the foresight signal? Measured on validation only.

    SCDVIZ_THREADS=1 python scripts/policy_lookahead.py [--per-domain 4] [--policies FILE ...] [--out F.json]

On the calib (validation) split of all six shipped domains (``--per-domain`` windows each:
512 context tokens + 24 teacher-forced), kept 25 % and 12.5 %, one token set per layer and
KV head, it prints the validation KL(full ‖ pruned) of top-B by
  * H2O's score (kvpress's ObservedAttention, alpha over all queries) and alpha over the
    last 64 queries (the 5-feature policy's heuristic);
  * the lookahead feature alone: the attention that K = 4 continuations of G = 16 tokens,
    sampled from the model itself after the context, pay to each token
    (``scdviz.evict.context.observe(lookahead=(16, 4))``);
  * the lookahead mixed with alpha (each normalised to sum 1 per row), weight 0.25 / 0.5 / 0.75;
  * the future attention itself (the true continuation's, an oracle nobody has);
  * any policy files given (``--policies``), e.g. a lookahead policy from ``train-policy --lookahead 16``;
with the paired-bootstrap ratio to H2O (95 % interval over the contexts) and the share of
contexts where it beats H2O; then each scorer's mean on the training domains' contexts
alone. The eval split is never read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from kvpress import ObservedAttentionPress

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, when scdviz is not installed
from scdviz import data, metrics  # noqa: E402
from scdviz.evict import features as F  # noqa: E402
from scdviz.evict import trainer  # noqa: E402
from scdviz.evict.context import observe  # noqa: E402
from scdviz.evict.policy import Policy, lookahead_prior  # noqa: E402
from scdviz.models import hf  # noqa: E402
from scdviz.models.pair import choose_threads, load_model  # noqa: E402

DOMAINS = ("jargon", "bible", "austen", "gcide", "handbook", "manpages")
CONTEXT, CONT, LOOK = 512, 24, (16, 4)


def prepare(model, tokenizer, per_domain: int) -> list[trainer.Sample]:
    """Validation samples with the lookahead column, H2O's scores and the true future's attention."""
    samples = []
    n_kv = hf.attn_heads(model)[1]
    for domain in DOMAINS:
        for window in data.token_windows(tokenizer, data.load_split(domain, "calib"), CONTEXT + CONT, per_domain):
            ids = hf.ids_tensor(window)
            obs = observe(model, ids[:, :CONTEXT], 64, {"H2O": ObservedAttentionPress()}, (0.5,), lookahead=LOOK)
            cont = ids[:, CONTEXT:]
            trace = hf.forward(model, cont, cache=hf.make_cache(model, obs.keys, obs.values),
                               positions=torch.arange(CONTEXT, CONTEXT + CONT).unsqueeze(0), attentions=True)
            future = F.future_attention(trace.attn, CONTEXT, n_kv)
            sample = trainer.Sample(obs, cont, trace.logits[0], future)
            sample.domain = domain
            samples.append(sample)
            print(f"  {domain}: context {len(samples)} prepared", flush=True)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-domain", type=int, default=4, help="validation windows per domain")
    ap.add_argument("--policies", nargs="*", default=[], help="policy files to score beside the heuristics")
    ap.add_argument("--out", default=None, help="write every per-context KL (JSON) here")
    args = ap.parse_args()
    choose_threads()
    model, tokenizer = load_model("builtin:smollm2-135m")
    with hf.eager(model):
        samples = prepare(model, tokenizer, args.per_domain)
        keeps = (0.25, 0.125)

        def column(i):
            return lambda s: s.obs.head_features[:, 0, ..., i].flatten(0, 1)

        scorers = {"H2O (ObservedAttention)": lambda s: torch.stack(s.obs.scores[("H2O", 0.5)], 0)[:, 0].flatten(0, 1),
                   "alpha, last 64 rows": column(0),
                   "lookahead (K = 4, G = 16)": column(5)}
        for lam in (0.25, 0.5, 0.75):  # the lookahead policies' prior at weight lam (its log: the same top-B)
            scorers[f"{lam:g} lookahead + {1 - lam:g} alpha"] = (
                lambda s, lam=lam: lookahead_prior(s.obs.head_features[:, 0], lam).flatten(0, 1))
        scorers["true future attention (oracle)"] = lambda s: trainer.warm_rows(s, True, "foresight")
        for path in args.policies:
            policy = Policy.load(path).to(hf.device_of(model))
            scorers[f"policy {Path(path).parent.name}/{Path(path).name}"] = lambda s, p=policy: trainer.rows(p, s.obs)
        kls = {name: trainer.validation_kls(model, fn, True, samples, keeps) for name, fn in scorers.items()}
    base = kls["H2O (ObservedAttention)"]
    print(f"\n{len(samples)} validation contexts ({args.per_domain} per domain, calib splits)")
    print(f"{'top-B by':42} {'kept':>6} {'val KL':>8} {'/ H2O [95% CI]':>24} {'beats H2O':>10}")
    for name, vals in kls.items():
        for j, keep in enumerate(keeps):
            a, b = base[j::2], vals[j::2]
            boot = metrics.paired_bootstrap(a, b)
            wins = sum(y < x for x, y in zip(a, b, strict=True)) / len(a)
            ci = f"{boot['ratio']:.3f} [{boot['ratio_ci'][0]:.3f}, {boot['ratio_ci'][1]:.3f}]"
            print(f"{name:42} {keep:6g} {sum(b) / len(b):8.4f} {ci:>24} {wins:10.2f}")
    train = [i for i, smp in enumerate(samples) if smp.domain in ("jargon", "bible")]  # the policies' own domains
    print(f"\non the training domains' calib text only (jargon, bible; {len(train)} contexts), mean over both budgets:")
    for name, vals in kls.items():
        print(f"{name:42} {sum(vals[2 * i] + vals[2 * i + 1] for i in train) / (2 * len(train)):8.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"domains": [s.domain for s in samples], "keeps": keeps, "kl": kls}))


if __name__ == "__main__":
    main()

"""Where SCD loses quote recall: each layer sent as the producer's raw K, V inside SCD reuse-only.

    python -m research.recall_layers                       # austen-before, its dev slice, every layer
    python -m research.recall_layers --consumer jargon --layers 3 4 5
    python -m research.recall_layers --raw 4 9            # one plan: these layers raw together

On austen-qkv (a specialist since retired: docs/history.md) the consumer with its own cache (the oracle)
recalled a quoted passage worse than with the producer's cache (raw reuse), and SCD, which reconstructs the
consumer's cache, recalled like the oracle. If that recall lives in a few layers (induction heads reading
previous-token keys), sending just those layers as the producer's raw K, V should buy it back at a cost in
bytes (one fp16 layer: 1/30 of raw reuse's payload) and in continuation KL. This probe measures, on the dev
slice (33 prompts of the specialist's own domain; it chooses, so it never reads test), for each layer l the
plan "SCD reuse-only, layer l raw": its KL over reuse-only's, its context-QA token-F1 less reuse-only's and
less raw reuse's (paired, passage-cluster intervals), and its bytes. ``--raw`` measures one plan with the
given layers raw together; ``--bits 4`` sends them as 4-bit KV does. The plan is ``plans.with_raw``, and
``bench scd --raw-layers`` runs the chosen layers beside the lineup.
"""

from __future__ import annotations

import argparse

from scdviz import metrics
from scdviz.models.pair import load_pair
from scdviz.scd import bench, calibration, measure
from scdviz.scd import plan as plans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--consumer", default="austen-before", help="built-in specialist")
    ap.add_argument("--layers", type=int, nargs="*", default=None, help="layers tried one at a time (default: all)")
    ap.add_argument("--raw", type=int, nargs="*", default=None, help="one plan: these layers raw together")
    ap.add_argument("--bits", type=int, default=16, choices=(4, 8, 16), help="bits of the raw layers' K, V")
    ap.add_argument("--limit", type=int, default=64, help="prompts spread through the dev slice")
    args = ap.parse_args()
    pair = load_pair("builtin:smollm2-135m", f"builtin:{args.consumer}")
    calib = calibration.Calibration.load(calibration.SHIPPED_DIR / args.consumer, pair)
    cfg = bench.ScdBenchConfig(slice="dev", limit=args.limit)
    domain = bench.eval_domains(cfg, args.consumer, calib)[0]
    windows = bench.eval_windows(None, cfg, pair, domain)
    clusters = [w.cluster for w in windows]
    cases = measure.prepare_cases(pair, [w.ids for w in windows], cfg.cont_len, True, cfg.qa_answer_len)
    base = plans.operating_plan(calib, patch_k=0, name="SCD reuse-only")
    raw = plans.raw_plan(calib.n_layers)
    layers = args.layers if args.layers is not None else range(calib.n_layers)
    tried = ([plans.with_raw(base, args.raw, args.bits)] if args.raw is not None else
             [plans.with_raw(base, [layer], args.bits) for layer in layers])
    got = measure.run_methods(pair, calib, cases, [raw, base, *tried], progress=True)
    by = {r.method: r for r in got}
    r_raw, r_base = by[raw.name], by[base.name]
    print(f"{args.consumer}, {domain} dev slice, {len(cases)} prompts; raw KV: KL {r_raw.kl:.4f}, QA F1 "
          f"{sum(r_raw.qa_f1) / len(r_raw.qa_f1):.3f}; SCD reuse-only: KL {r_base.kl:.4f} "
          f"({r_base.kl / r_raw.kl:.3f}x raw), QA F1 {sum(r_base.qa_f1) / len(r_base.qa_f1):.3f}, "
          f"{r_base.payload_bytes_per_token:,.0f} B/token")
    print("plan | B/token | KL / reuse-only [95%] | KL / raw | QA F1 | - reuse-only [95%] | - raw [95%]")
    for plan in tried:
        r = by[plan.name]
        kl = metrics.paired_bootstrap(r_base.kl_per_prompt, r.kl_per_prompt, clusters=clusters)
        qa = {name: metrics.paired_bootstrap(other.qa_f1, r.qa_f1, clusters=clusters)
              for name, other in (("base", r_base), ("raw", r_raw))}
        print(f"{plan.name} | {r.payload_bytes_per_token:,.0f} | {r.kl / r_base.kl:.3f} "
              f"[{kl['ratio_ci'][0]:.3f}, {kl['ratio_ci'][1]:.3f}] | {r.kl / r_raw.kl:.3f} | "
              f"{sum(r.qa_f1) / len(r.qa_f1):.3f} | "
              + " | ".join(f"{q['diff']:+.3f} [{q['diff_ci'][0]:+.3f}, {q['diff_ci'][1]:+.3f}]"
                           for q in qa.values()))


if __name__ == "__main__":
    main()

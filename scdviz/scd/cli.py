"""SCD commands: ``python -m scdviz calibrate`` and ``python -m scdviz bench scd``.

Thin wrappers: argument parsing, choosing defaults (the built-in specialists, their
shipped calibration and evaluation text), printing tables, writing JSON. The work is in
scdviz.scd.calibrate and scdviz.scd.bench.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def register(sub, bench_sub) -> None:
    """Add ``calibrate`` to the top-level commands and ``scd`` to the bench commands."""
    p = sub.add_parser("calibrate", help="fit an SCD calibration (codes, aligners, patch layers) for a pair")
    p.add_argument("--producer", default="builtin:smollm2-135m")
    p.add_argument("--consumer", default="builtin:jargon")
    p.add_argument("--corpus", help="shipped corpus for the calib split (default: the specialist's name)")
    p.add_argument("--texts", help=".txt or .jsonl calibration text instead of a shipped split")
    p.add_argument("--out", help="output folder (default: assets/scd/<specialist> for built-ins)")
    p.add_argument("--n-fit", type=int, default=32, help="windows for the fits")
    p.add_argument("--n-select", type=int, default=6, help="windows for patch selection")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--selection", default="greedy", choices=["greedy", "drift", "given"])
    p.add_argument("--patch-layers", type=int, nargs="*", default=[], help="layers for --selection given")
    p.add_argument("--patch-k", type=int, default=8, help="patch layers ordered (sweep range)")
    p.add_argument("--candidates", type=int, default=10, help="layers that get an aligner")
    p.add_argument("--rank-h", type=int, help="PATCH code width (default: whole normalised H_in)")
    p.add_argument("--aligner-steps", type=int, default=300)
    p.add_argument("--aligner-loss", default="kv", choices=["kv", "h"])
    p.add_argument("--bits", type=int, default=4, choices=[4, 8, 16], help="operating point: code bits")
    p.add_argument("--group", type=int, default=64, help="operating point: tokens per code quantisation group")
    p.add_argument("--budget", type=float, help="operating point: payload bytes/token (default: full rank)")
    p.add_argument("--op-k", type=int, default=6, help="operating point: patch layers")
    p.add_argument("--store-rank", type=int, help="store codes up to this rank only")
    p.set_defaults(fn=_calibrate)

    p = bench_sub.add_parser("scd", help="every SCD method and baseline on held-out text")
    p.add_argument("--producer", default="builtin:smollm2-135m")
    p.add_argument("--consumer", nargs="*", help="consumers (default: every built-in specialist)")
    p.add_argument("--calib", nargs="*", help="calibration folders, one per consumer (default: assets/scd/<name>)")
    p.add_argument("--texts", help=".txt or .jsonl evaluation text (default: the specialist's eval split)")
    p.add_argument("--limit", type=int, default=16, help="prompts")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--cont-len", type=int, default=32, help="teacher-forced continuation tokens")
    p.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens for token-F1 (0: skip)")
    p.add_argument("--sweeps", action="store_true", help="also the patch-budget sweep k = 0..patch_k")
    p.add_argument("--budgets", type=float, nargs="*", default=[], help="rank sweep: bytes/token budgets")
    p.add_argument("--out", help="write JSON records here")
    p.set_defaults(fn=_bench)


def _calibrate(args) -> None:
    from scdviz import data
    from scdviz.models.pair import load_pair
    from scdviz.scd import calibrate as cal

    name = cal.specialist_name(args.consumer)
    corpus = args.corpus or (name if name in data.corpora() else None)
    if corpus is None and not args.texts:
        raise ValueError(f"no shipped corpus named {name!r}; pass --corpus ({', '.join(data.corpora())}) or --texts")
    out = Path(args.out) if args.out else cal.shipped_folder(args.consumer)
    cfg = cal.CalibConfig(
        corpus=corpus or "", texts=args.texts, n_fit=args.n_fit, n_select=args.n_select, prompt_len=args.prompt_len,
        rank_h=args.rank_h, aligner_steps=args.aligner_steps, aligner_loss=args.aligner_loss,
        n_candidates=args.candidates, patch_k=args.patch_k, selection=args.selection, given=args.patch_layers,
        code_bits=args.bits, code_group=args.group, budget_bytes=args.budget, op_patch_k=args.op_k,
    )
    pair = load_pair(args.producer, args.consumer)
    calib = cal.calibrate(pair, cfg)
    cal.save(calib, out, args.store_rank)
    print(f"patch order ({cfg.selection}): {calib.patch_order}; drift order: {calib.drift_order}")
    if calib.selection_kl:
        print("selection KL after each added patch: " + ", ".join(f"{x:.4f}" for x in calib.selection_kl))
    print(f"saved to {out} in {calib.stats['seconds_total']} s")


def _bench(args) -> None:
    from scdviz import data
    from scdviz.models import builtin
    from scdviz.models.pair import load_pair
    from scdviz.scd import bench
    from scdviz.scd import calibrate as cal

    consumers = args.consumer or [f"builtin:{s}" for s in builtin.specialists()]
    if not consumers:
        raise ValueError("no consumer given and no built-in specialist installed")
    folders = args.calib or [str(cal.shipped_folder(c)) for c in consumers]
    if len(folders) != len(consumers):
        raise ValueError("give one --calib folder per --consumer")
    recs = []
    for consumer, folder in zip(consumers, folders):
        name = cal.specialist_name(consumer)
        pair = load_pair(args.producer, consumer)
        calib = cal.load(folder, pair)
        passages = data.read_passages(args.texts) if args.texts else data.load_split(calib.config.corpus or name, "eval")
        windows = data.token_windows(pair.tokenizer, passages, args.prompt_len + args.cont_len, args.limit)
        if not windows:
            raise ValueError(f"the evaluation text has no window of {args.prompt_len + args.cont_len} tokens")
        report = bench.bench(pair, calib, windows, args.cont_len, args.gen_tokens, args.sweeps, tuple(args.budgets), name)
        print(f"\n== {name} ({len(windows)} prompts of {args.prompt_len} tokens + {args.cont_len}) ==")
        print(report.table().to_string(index=False))
        proj = [p for p in report.projection if p["model"] == "Mistral-7B" and p["gpu"] == bench.PROJECTION_GPU.name and p["link_gbps"] == 10]
        print(f"analytic projection (not measured): {bench.PROJECTION_GPU.name}, {bench.PROJECTION_TOKENS} tokens, 10 Gbit/s, Mistral-7B: "
              + ", ".join(f"{p['method']} {p['speedup']:.2f}x" for p in proj))
        recs += bench.records(report)
    if args.out:
        Path(args.out).write_text(json.dumps(_finite(recs), indent=1))
        print(f"wrote {len(recs)} records to {args.out}")


def _finite(obj):
    """NaN / inf -> None so the JSON is strict."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, list):
        return [_finite(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    return obj

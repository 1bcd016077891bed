"""SCD's trained correction stage at several training-set sizes, side by side on the same windows (issue 61).

Each calibration given (``--calibs LABEL=FOLDER ...``: the same closed form, its correction stage trained on a
different number of windows or with another recipe) is measured on the same eval windows of the consumer's own
domain, at the three operating points the stage is trained at (the calibration's own plan, transform coded at 3,840
and 2,304 B/token), beside raw KV reuse and the closed form (the first calibration's, without its stage). Per
prompt: KL(oracle ‖ method) of the teacher-forced continuation, top-1 agreement and the context-QA token F1
(scdviz.qa). Printed: each arm's mean KL, its ratio to raw KV and to the first arm with paired passage-bootstrap
intervals; ``--out`` writes the record, every per-prompt value (what docs/results.md's data-size table is made
from). Choices are made on ``--slice dev``; ``test`` runs only from a clean committed tree.

    python -m research.distil_scale --consumer builtin:austen-before --limit 64 \\
        --calibs 1x=runs/ablate/x1/out 3x=runs/ablate/x3/out --out runs/ablate/dev.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from scdviz import data, metrics, protocol, records
from scdviz.models import builtin
from scdviz.models.pair import choose_threads, load_pair
from scdviz.scd import calibration, distil, measure
from scdviz.scd import plan as plans

BUDGETS = tuple(distil.DistilConfig().budgets)  # the plans the shipped stage is trained at


def arms(pair, specs: list[str]) -> list[tuple[str, calibration.Calibration]]:
    """(label, calibration) of each ``LABEL=FOLDER``, after the closed form of the first one."""
    out = []
    for spec in specs:
        label, _, folder = spec.partition("=")
        if not folder:
            raise SystemExit(f"--calibs takes LABEL=FOLDER, got {spec!r}")
        out.append((label, calibration.Calibration.load(Path(folder), pair)))
    tags = {c.closed_form().tag for _, c in out}
    if len(tags) != 1:
        raise SystemExit("every calibration must share one closed form (the same base, trained differently)")
    return [("closed form", out[0][1].closed_form()), *out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--producer", default="builtin:smollm2-135m")
    ap.add_argument("--consumer", default="builtin:austen-before")
    ap.add_argument("--calibs", nargs="+", required=True, help="LABEL=FOLDER, one per arm")
    ap.add_argument("--slice", default="dev", choices=data.SLICES)
    ap.add_argument("--limit", type=int, default=64, help="windows of the consumer's own domain")
    ap.add_argument("--other-limit", type=int, default=0, help="windows of each other shipped domain (0: none)")
    ap.add_argument("--budgets", type=float, nargs="*", default=list(BUDGETS),
                    help="bytes per token of the transform-coded plans measured")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--cont-len", type=int, default=32)
    ap.add_argument("--qa-answer-len", type=int, default=8)
    ap.add_argument("--out", default="", help="write the record here (every per-prompt value)")
    args = ap.parse_args()
    protocol.check_slice(args.slice)
    print(f"torch threads: {choose_threads()}")
    t0 = time.perf_counter()
    pair = load_pair(args.producer, args.consumer)
    domain = builtin.training_corpus(args.consumer.removeprefix("builtin:"))
    if domain is None:
        raise SystemExit(f"{args.consumer} is not a built-in specialist with a known training corpus")
    groups = arms(pair, args.calibs)
    run_plans, run_calibs, labels = [plans.raw_plan(pair.consumer_facts.layers)], [None], ["raw KV"]
    for label, calib in groups:
        for p in distil.trained_plans(calib, distil.DistilConfig(budgets=list(args.budgets))):
            run_plans.append(p)
            run_calibs.append(calib)
            labels.append(f"{p.name} [{label}]")
    others = [d for d in data.corpora() if d != domain] if args.other_limit else []
    scopes = [(f"{domain} (own domain)", [domain], args.limit)]
    if others:
        scopes.append((f"the {len(others)} other domains", others, args.other_limit))
    rows, first = [], groups[1][0]
    for scope, domains, limit in scopes:
        windows = [w for d in domains
                   for w in data.eval_windows(pair.tokenizer, d, args.slice, args.prompt_len + args.cont_len, limit)]
        clusters = [w.cluster for w in windows]
        torch.manual_seed(0)
        cases = measure.prepare_cases(pair, [w.ids for w in windows], args.cont_len, True, args.qa_answer_len)
        results = measure.run_methods(pair, run_calibs, cases, run_plans, progress=True)
        mine = []
        for label, r in zip(labels, results, strict=True):
            name, _, arm = label.partition(" [")
            arm = arm.rstrip("]")
            calib = dict(groups).get(arm)
            mine.append({"scope": scope, "method": name, "arm": arm or "raw KV", "kl": r.kl, "top1": r.top1,
                         "qa_f1_mean": sum(r.qa_f1) / len(r.qa_f1), "bytes_per_token": r.payload_bytes_per_token,
                         "kl_per_prompt": r.kl_per_prompt, "qa_f1": r.qa_f1, "passages": clusters,
                         "domains": [w.domain for w in windows],
                         "training": {} if calib is None else _training(calib)})
        print(f"{args.consumer} on {len(windows)} {args.slice} windows of {scope} ({len({*clusters})} passages); "
              "ratios with 95% passage-bootstrap intervals")
        print(protocol.show(_frame(mine, results[0], first, clusters)))
        rows += mine
    if args.out:
        settings = {"research": "distil_scale", "consumer": args.consumer, "calibs": args.calibs,
                    "slice": args.slice, "limit": args.limit, "other_limit": args.other_limit, "budgets": args.budgets,
                    "prompt_len": args.prompt_len, "cont_len": args.cont_len, "qa_answer_len": args.qa_answer_len}
        records.write(records.make("scd", settings, 0, rows, str(pair.device), time.perf_counter() - t0),
                      Path(args.out))
        print(f"record: {args.out}")


def _training(calib: calibration.Calibration) -> dict:
    """What a calibration's correction stage was trained on (its distil log), for the record."""
    log = calib.stats.get("distil", {})
    if not log:
        return {}
    keep = ("train_windows", "val_windows", "best_epoch", "best_step", "val_steps", "val_kl", "val_kl_by_plan",
            "train_kl", "seconds")
    return {k: log[k] for k in keep if k in log} | {"config": log.get("config", {})}


def _frame(rows: list[dict], raw, first: str, clusters: list[str]):
    """The printed table: each row's KL against raw KV's and the first arm's at the same plan, paired over prompts
    with whole passages resampled."""
    import pandas as pd

    def vs(base: list[float], mine: list[float]) -> str:
        got = metrics.paired_bootstrap(base, mine, clusters=clusters)
        return f"{got['ratio']:.3f} [{got['ratio_ci'][0]:.3f}, {got['ratio_ci'][1]:.3f}]"

    first_of = {r["method"]: r for r in rows if r["arm"] == first}
    return pd.DataFrame([{"method": r["method"], "arm": r["arm"], "KL": round(r["kl"], 5), "top-1": round(r["top1"], 3),
                          "QA F1": round(r["qa_f1_mean"], 3), "B/token": round(r["bytes_per_token"]),
                          "x raw": vs(raw.kl_per_prompt, r["kl_per_prompt"]),
                          f"x {first}": (vs(first_of[r["method"]]["kl_per_prompt"], r["kl_per_prompt"])
                                         if r["method"] in first_of and r["arm"] != first else "")}
                         for r in rows])


if __name__ == "__main__":
    main()

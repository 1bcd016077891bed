"""Paired comparison of learned eviction policies against every baseline of one or more bench evict records.

    python -m research.evict_paired RECORD.json [MORE_RECORDS.json ...] [--method NAME] [--against NAME ...]

``bench evict`` records hold every method's KL per context. Records made on the same
contexts (same settings and eval text; the script checks that every method the records
share has the same per-context KL, up to the float rounding of another CPU (``_same``: the evaluation
is deterministic on one machine, and differs in the 6th decimal between machines)) can
be joined: e.g. a new policy scored without kvpress's native presses (``--no-natives``)
beside an earlier record that ran them. For each budget it prints the policy's KL, the best
baseline over all the records (lowest mean KL), the paired-bootstrap 95 % interval of the
difference and of the ratio, wins against that baseline and against each context's best
baseline, context-QA accuracy and F1 where recorded; with ``--against``, each policy's KL over each
named method's (e.g. ObservedAttention, or a policy's own earlier stage) with its interval; then, per
domain, ``bench evict``'s own domain table (``scdviz.evict.bench.domain_table``) over the joined rows.
Intervals resample whole passages (the cluster bootstrap), as the benchmark's own do.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scdviz import metrics
from scdviz.evict import bench as compare


def _same(a: list[float], b: list[float]) -> bool:
    """Per-context KLs of one method in two records: equal up to another machine's float rounding
    (seen: at most 7.6e-5 on KLs of 0.02-1.5; other contexts differ by orders of magnitude more)."""
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 + 1e-3 * abs(y) for x, y in zip(a, b, strict=True))


def rows_of(paths: list[str], mode: str) -> dict[tuple[str, str], dict]:
    """(method, keep) -> row, joined over the records, checking shared methods agree per context."""
    out, domains, largest = {}, None, 0.0
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            if row.get("mode") != mode or "kl_per_context" not in row:
                continue
            if domains is None:
                domains = row["domains"]
            elif row["domains"] != domains:
                raise SystemExit(f"{path}: its contexts are not the first record's (domains differ)")
            key = (row["method"], row["keep"])
            if key in out and not _same(out[key]["kl_per_context"], row["kl_per_context"]):
                raise SystemExit(f"{path}: {key} differs per context from the record before: not the same contexts")
            if key in out:
                largest = max(largest, *(abs(x - y) for x, y in zip(out[key]["kl_per_context"], row["kl_per_context"])))
            out.setdefault(key, row)
    if not out:
        raise SystemExit(f"no rows of mode {mode!r} with per-context KL in {paths}")
    if len(paths) > 1:
        print(f"methods the records share agree per context to within {largest:.1e} (KL)")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m research.evict_paired", description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+", help="bench evict records (record.json) made on the same contexts")
    ap.add_argument("--method", nargs="*", default=None, help="learned methods to compare (default: all non-baselines)")
    ap.add_argument("--mode", default="agnostic", help="record mode to read (default: agnostic)")
    ap.add_argument("--against", nargs="*", default=(), help="also each learned method's KL over these methods'")
    args = ap.parse_args(argv)
    rows = rows_of(args.records, args.mode)
    domains = next(iter(rows.values()))["domains"]
    passages = next(iter(rows.values())).get("passages")
    keeps = sorted({k for _, k in rows}, key=float, reverse=True)
    learned = args.method or sorted({m for (m, _), r in rows.items() if not r.get("baseline")})
    print(f"{len(domains)} contexts; records: {', '.join(args.records)}")
    for keep in keeps:
        base = {m: r for (m, k), r in rows.items() if k == keep and r.get("baseline")}
        best = min(base, key=lambda m: base[m]["kl"])
        ctx_best = [min(r["kl_per_context"][i] for r in base.values()) for i in range(len(domains))]
        print(f"\nkept {keep}: best baseline {best} (KL {base[best]['kl']:.4f}, QA {base[best].get('qa_acc')})")
        print(f"{'method':34} {'KL':>8} {'− best [95% CI]':>28} {'/ best [95% CI]':>24} {'wins':>5} {'ctx-best':>8} "
              f"{'QA':>5}")
        for m in learned:
            if (m, keep) not in rows:
                continue
            r = rows[(m, keep)]
            a, b = base[best]["kl_per_context"], r["kl_per_context"]
            boot = metrics.paired_bootstrap(a, b, clusters=passages)
            wins = sum(y < x for x, y in zip(a, b, strict=True)) / len(a)
            wins_ctx = sum(y < x for x, y in zip(ctx_best, b, strict=True)) / len(a)
            diff = f"{boot['diff']:+.4f} [{boot['diff_ci'][0]:+.4f}, {boot['diff_ci'][1]:+.4f}]"
            ratio = f"{boot['ratio']:.3f} [{boot['ratio_ci'][0]:.3f}, {boot['ratio_ci'][1]:.3f}]"
            qa = r.get("qa_acc")
            print(f"{m:34} {r['kl']:8.4f} {diff:>28} {ratio:>24} {wins:5.2f} {wins_ctx:8.2f} "
                  f"{'' if qa is None else f'{qa:5.2f}'}")
        full = rows.get(("full cache", "1"), {})
        for m in learned:
            for ref in args.against:
                if (m, keep) not in rows or (ref, keep) not in rows or ref == m:
                    continue
                r, o = rows[(m, keep)], rows[(ref, keep)]
                boot = metrics.paired_bootstrap(o["kl_per_context"], r["kl_per_context"], clusters=passages)
                qa = "" if "qa_f1" not in r else (f"; QA F1 {r['qa_f1']:.3f} vs {o['qa_f1']:.3f}" + (
                    f" (full cache {full['qa_f1']:.3f})" if "qa_f1" in full else ""))
                print(f"  {m} / {ref}: {boot['ratio']:.3f} [{boot['ratio_ci'][0]:.3f}, {boot['ratio_ci'][1]:.3f}]"
                      f"; top-1 {r['top1']:.3f} vs {o['top1']:.3f}{qa}")
    for m in learned:  # per domain: scdviz's own table, over the joined rows
        print(f"\nper domain, {m} against the best baseline on that domain's contexts:")
        print(compare.domain_text(compare.domain_table(list(rows.values()), m)))


if __name__ == "__main__":
    main()

"""Paired comparison of two `bench scd` records of the same prompts: per method both hold,
KL of the second relative to the first with a paired-bootstrap interval over prompts.

    python -m research.compare_records OLD.json NEW.json [--methods NAME ...]
    python -m research.compare_records RECORD.json --twins
    python -m research.compare_records RECORD.json --vs-raw
    python -m research.compare_records RECORD.json --tails

``--twins``: one record of a calibration with a trained correction stage; each SCD method against its
"(closed form)" twin on the same prompts (interval over passages, the cluster bootstrap), with both
methods' KL over raw KV's, top-1 and QA F1.

``--tails``: one ``bench scd --tails`` record; each method whose consumer recomputed the prompt's last
tokens against raw KV and against the same method without the tail (KL ratios, QA F1 less raw's, all with
passage-cluster intervals), with its bytes and its compute share.

A record from an earlier commit: `git show REV:assets/scd/NAME/bench.json > old.json`.
Rows are matched by (specialist, domain, method); rows without per-prompt KL are skipped.
"""

from __future__ import annotations

import argparse
import sys

from scdviz import metrics, records


def per_prompt(path: str) -> dict[tuple, list[float]]:
    """(specialist, domain, method) -> per-prompt KL of one record."""
    rows = records.read(path).rows
    return {(r.get("specialist"), r.get("domain"), r["method"]): r["kl_per_prompt"] for r in rows
            if r.get("kl_per_prompt")}


def twins(path: str) -> None:
    """Each trained SCD method of one record against its closed-form twin (see the module docstring)."""
    from scdviz.scd.plan import CLOSED

    base, mine_suffix = CLOSED, ""
    rows = [r for r in records.read(path).rows if r.get("row") == "measured" and r.get("kl_per_prompt")]
    by = {(r["specialist"], r["domain"], r["method"]): r for r in rows}
    ratio, arrow = "trained / closed", "closed -> trained"
    print(f"specialist domain method: {ratio} KL [95%, passages] | KL/raw {arrow} | top-1 {arrow} | "
          f"QA F1 raw, {arrow} | B/token")
    for (spec, dom, method), closed in by.items():
        if not method.endswith(base):
            continue
        mine, raw = by.get((spec, dom, method[: -len(base)] + mine_suffix)), by.get((spec, dom, "raw KV"))
        if mine is None or raw is None:
            continue
        r = metrics.paired_bootstrap(closed["kl_per_prompt"], mine["kl_per_prompt"], clusters=mine.get("passages"))
        qa = lambda row: "-" if row.get("qa_f1") is None else f"{row['qa_f1']:.3f}"  # noqa: E731
        print(f"{spec} {dom} {method[: -len(base)] + mine_suffix}: {r['ratio']:.3f} [{r['ratio_ci'][0]:.3f}, "
              f"{r['ratio_ci'][1]:.3f}] | {closed['kl'] / raw['kl']:.3f} -> {mine['kl'] / raw['kl']:.3f} | "
              f"{closed['top1']:.3f} -> {mine['top1']:.3f} | {qa(raw)}, {qa(closed)} -> {qa(mine)} | "
              f"{mine['payload_bytes_per_token']:.0f}")


def vs_raw(path: str) -> None:
    """Each SCD method of one record (trained and closed form) against raw KV reuse on the same prompts: QA
    token-F1 minus raw reuse's and KL over raw reuse's, with the passage-cluster bootstrap's 95% intervals."""
    rows = [r for r in records.read(path).rows if r.get("row") == "measured" and r.get("kl_per_prompt")]
    by = {(r["specialist"], r["domain"], r["method"]): r for r in rows}
    print("specialist domain method: items | QA F1 (raw) | QA - raw [95%, passages] | KL / raw [95%] | top-1")
    for (spec, dom, method), r in by.items():
        raw = by.get((spec, dom, "raw KV"))
        if not method.startswith("SCD") or raw is None or not r.get("qa_f1_items"):
            continue
        qa = metrics.paired_bootstrap(raw["qa_f1_items"], r["qa_f1_items"], clusters=r.get("passages"))
        kl = metrics.paired_bootstrap(raw["kl_per_prompt"], r["kl_per_prompt"], clusters=r.get("passages"))
        print(f"{spec} {dom} {method}: {len(r['qa_f1_items'])} | {r['qa_f1']:.3f} ({raw['qa_f1']:.3f}) | "
              f"{qa['diff']:+.3f} [{qa['diff_ci'][0]:+.3f}, {qa['diff_ci'][1]:+.3f}] | "
              f"{r['kl'] / raw['kl']:.3f} [{kl['ratio_ci'][0]:.3f}, {kl['ratio_ci'][1]:.3f}] | {r['top1']:.3f}")


def tails(path: str) -> None:
    """Each tailed method of one record against raw KV and against its untailed base (module docstring)."""
    from scdviz.scd.plan import base_name

    rows = [r for r in records.read(path).rows if r.get("row") == "measured" and r.get("kl_per_prompt")]
    by = {(r["specialist"], r["domain"], r["method"]): r for r in rows}
    print("specialist domain method: KL / raw [95%, passages] | KL / without the tail [95%] | top-1 | "
          "QA F1 - raw [95%] | B/token | compute share")
    for (spec, dom, method), r in by.items():
        base, raw = base_name(method), by.get((spec, dom, "raw KV"))
        if base == method or raw is None:
            continue
        cut = r.get("passages")
        kl = metrics.paired_bootstrap(raw["kl_per_prompt"], r["kl_per_prompt"], clusters=cut)
        line = f"{spec} {dom} {method}: {kl['ratio']:.3f} [{kl['ratio_ci'][0]:.3f}, {kl['ratio_ci'][1]:.3f}] | "
        own = by.get((spec, dom, base))
        if own is not None:
            b = metrics.paired_bootstrap(own["kl_per_prompt"], r["kl_per_prompt"], clusters=cut)
            line += f"{b['ratio']:.3f} [{b['ratio_ci'][0]:.3f}, {b['ratio_ci'][1]:.3f}] | "
        else:
            line += "- | "
        line += f"{r['top1']:.3f} | "
        if r.get("qa_f1_items") and raw.get("qa_f1_items"):
            qa = metrics.paired_bootstrap(raw["qa_f1_items"], r["qa_f1_items"], clusters=cut)
            line += f"{qa['diff']:+.3f} [{qa['diff_ci'][0]:+.3f}, {qa['diff_ci'][1]:+.3f}] | "
        else:
            line += "- | "
        print(line + f"{r['payload_bytes_per_token']:.0f} | {r.get('prefill_share', float('nan')):.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m research.compare_records", description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new", nargs="?")
    ap.add_argument("--methods", nargs="*", default=None, help="only these methods (default: every shared one)")
    ap.add_argument("--twins", action="store_true", help="one record: each trained method against its closed form")
    ap.add_argument("--vs-raw", action="store_true", help="one record: each SCD method's QA and KL against raw "
                    "KV reuse on the same prompts")
    ap.add_argument("--tails", action="store_true", help="one record (bench scd --tails): each method with a "
                    "recomputed tail against raw KV and against itself without the tail")
    args = ap.parse_args(argv)
    if args.tails:
        return tails(args.old)
    if args.vs_raw:
        return vs_raw(args.old)
    if args.twins:
        return twins(args.old)
    if args.new is None:
        sys.exit("two records to compare, or one with --twins")
    old, new = per_prompt(args.old), per_prompt(args.new)
    shared = [k for k in old if k in new and (args.methods is None or k[2] in args.methods)]
    if not shared:
        sys.exit("the two records share no method with per-prompt KL (same prompts, same method names?)")
    for key in shared:
        if len(old[key]) != len(new[key]):
            print(f"{key[2]}: {len(old[key])} vs {len(new[key])} prompts, not paired; skipped")
            continue
        r = metrics.paired_bootstrap(old[key], new[key])
        print(f"{key[0]} {key[1]} {key[2]}: new / old KL {r['ratio']:.3f} "
              f"[{r['ratio_ci'][0]:.3f}, {r['ratio_ci'][1]:.3f}] ({r['n']} prompts)")


if __name__ == "__main__":
    main()

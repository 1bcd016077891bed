"""Paired comparison against raw KV reuse inside one `bench scd` record: per SCD method (trained and its
closed form), QA token-F1 minus raw reuse's and KL over raw reuse's, each with the passage-cluster
bootstrap's 95% interval, and top-1.

    python -m research.scd_vs_raw assets/scd/jargon/test.json assets/scd/austen-qkv/test.json
"""

from __future__ import annotations

import argparse
import json

from scdviz import metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+")
    args = ap.parse_args()
    print("record | method | items | QA F1 (raw) | QA − raw [95%] | KL / raw [95%] | top-1")
    for path in args.records:
        with open(path) as fh:
            rows = json.load(fh)["rows"]
        for dom in sorted({r["domain"] for r in rows if r.get("row") == "measured"}):
            by = {r["method"]: r for r in rows if r.get("row") == "measured" and r["domain"] == dom
                  and r.get("group") in ("method", "budget sweep")}
            raw = by["raw KV"]
            for name, r in by.items():
                if not name.startswith("SCD") or not r.get("qa_f1_items"):
                    continue
                qa = metrics.paired_bootstrap(raw["qa_f1_items"], r["qa_f1_items"], clusters=r.get("passages"))
                kl = metrics.paired_bootstrap(raw["kl_per_prompt"], r["kl_per_prompt"], clusters=r.get("passages"))
                print(f"{path} [{dom}] | {name} | {len(r['qa_f1_items'])} | {r['qa_f1']:.3f} ({raw['qa_f1']:.3f}) | "
                      f"{qa['diff']:+.3f} [{qa['diff_ci'][0]:+.3f}, {qa['diff_ci'][1]:+.3f}] | "
                      f"{r['kl'] / raw['kl']:.3f} [{kl['ratio_ci'][0]:.3f}, {kl['ratio_ci'][1]:.3f}] | {r['top1']:.3f}")


if __name__ == "__main__":
    main()

"""Paired comparison of two `bench scd` records of the same prompts: per method both hold,
KL of the second relative to the first with a paired-bootstrap interval over prompts.

    python -m research.compare_records OLD.json NEW.json [--methods NAME ...]

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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m research.compare_records", description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--methods", nargs="*", default=None, help="only these methods (default: every shared one)")
    args = ap.parse_args(argv)
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

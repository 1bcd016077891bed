"""What every method's benchmark does alike: domains, leave-one-domain-out, the comparison against
the best baseline, paired intervals, records and printed tables.

Both benches (``scdviz.scd.bench`` and ``scdviz.evict.bench``) go through this module, so the
protocol is written once:

- ``by_domain`` measures each domain, either with the artefact the caller holds or, for
  leave-one-domain-out, with an artefact fitted again without that domain (``fit``);
- ``check_slice`` guards the slices of the eval text (``scdviz.data``): ``dev`` for iterating,
  ``test`` only from a clean committed tree, so a test record always names the code it ran;
- ``vs_best`` compares one method's per-item values (KL per prompt or context) with the best of
  a set of baselines on the same items: which baseline is best (lowest mean), the paired
  bootstrap interval of the difference and ratio (``scdviz.metrics.paired_bootstrap``, over
  whole passages when the items carry ``clusters``), wins;
- ``per_domain`` does the same on each domain's items alone;
- ``record`` / ``merge`` turn a bench's rows into a ``scdviz.records.BenchRecord``;
- ``show`` prints a table (a pandas DataFrame) the one way the CLI prints every table.

It knows no method, model or file: the callers give values and functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import pandas as pd

from scdviz import data, metrics, records


def check_slice(slice_: str) -> None:
    """ValueError unless ``slice_`` is an eval slice and, for ``test``, the checkout is a clean git tree and the
    one this process loaded its code from: a test-slice record must name committed code
    (``records.loaded_commit``, the commit its record is stamped with however long the run takes)."""
    if slice_ not in data.SLICES:
        raise ValueError(f"unknown slice {slice_!r}; use one of {', '.join(data.SLICES)}")
    if slice_ == "test":
        loaded, now = records.loaded_commit(), records.git_commit()
        if loaded is None or loaded.endswith("+dirty"):
            raise ValueError("a run on the test slice needs a clean, committed git checkout (its record names the "
                             f"commit it ran; this one is {loaded or 'not a git checkout'}): commit or stash your "
                             "changes, or measure on --slice dev")
        if now != loaded:
            raise ValueError("a run on the test slice needs a clean, committed git checkout, and this one changed "
                             f"since this process loaded its code ({loaded}; now {now}): start the run again")


def by_domain(domains: Sequence[str], evaluate: Callable, artefact=None, *, fit: Callable | None = None,
              seen: Sequence[str] = (), what: str = "artefact") -> list:
    """``evaluate(domain, artefact)`` for each of ``domains``, in order; returns the results.

    Without ``fit`` every domain is measured with the caller's ``artefact``. With ``fit``,
    leave-one-domain-out: ``seen`` are the domains the caller's artefact was made from; each
    domain (one of them) is measured with ``fit(others)``, others = ``seen`` without it, in
    their order, so the artefact measured on a domain never saw it. ValueError when fewer
    than two domains were seen or a domain was not among them (``what`` names the artefact).
    """
    if fit is None:
        return [evaluate(domain, artefact) for domain in domains]
    seen = list(seen)
    if len(seen) < 2:
        raise ValueError(f"leave-one-domain-out needs a {what} of 2+ domains; this one saw {seen or 'one text'}")
    if unseen := set(domains) - set(seen):
        raise ValueError(f"leave-one-domain-out can leave out only a domain the {what} saw ({', '.join(seen)}); "
                         f"not {', '.join(sorted(unseen))}")
    return [evaluate(domain, fit([d for d in seen if d != domain])) for domain in domains]


def best_of(values: dict[str, list[float]], baselines: Iterable[str]) -> str:
    """The baseline with the lowest mean value (the first of equals, in ``baselines``' order)."""
    return min(baselines, key=lambda m: sum(values[m]))


def vs_best(values: dict[str, list[float]], method: str, baselines: Iterable[str], min_n: int = 2,
            clusters: Sequence | None = None) -> dict:
    """``method``'s per-item values against the best of ``baselines`` on the same items.

    values: method -> one value per item (lower is better), items paired across methods.
    Returns {"best" (the baseline with the lowest mean), "mean", "best_mean" (sum / n),
    "n", "wins" (fraction of items where ``method`` is lower), "above" (items where it is
    higher), "boot" (``metrics.paired_bootstrap(best, method)``: method - best and method / best
    with 95% intervals, resampling whole ``clusters`` when given; None with fewer than ``min_n``
    items)}. A ``method`` that is itself the best is compared with itself (no wins, a zero
    difference): callers that list baselines say so.
    """
    best = best_of(values, baselines)
    mine, theirs = values[method], values[best]
    n = len(mine)
    return {"best": best, "mean": sum(mine) / n, "best_mean": sum(theirs) / n, "n": n,
            "wins": sum(a < b for a, b in zip(mine, theirs, strict=True)) / n,
            "above": sum(a > b for a, b in zip(mine, theirs, strict=True)),
            "boot": metrics.paired_bootstrap(theirs, mine, clusters=None if clusters is None else list(clusters))
            if n >= min_n else None}


def per_domain(domains: Sequence[str], values: dict[str, list[float]], method: str, baselines: Iterable[str],
               min_n: int = 2, clusters: Sequence | None = None) -> list[tuple[str, dict]]:
    """(domain, ``vs_best`` on that domain's items alone) per domain, in order of first appearance.

    domains: the domain of each item (as long as each list in ``values``); the best baseline is
    chosen again on each domain's items; ``clusters`` as in ``vs_best``, one per item."""
    baselines = list(baselines)
    out = []
    for domain in dict.fromkeys(domains):
        at = [i for i, d in enumerate(domains) if d == domain]
        sub = None if clusters is None else [clusters[i] for i in at]
        out.append((domain, vs_best({m: [v[i] for i in at] for m, v in values.items()}, method, baselines, min_n,
                                    sub)))
    return out


def interval(ci: Sequence[float] | None, fmt: str = ".3f") -> str:
    """A 95% interval as a table cell, ``[lo, hi]``; empty for None."""
    return "" if ci is None else f"[{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def record(kind: str, rows: list[dict], settings: dict, seed: int, device: str = "",
           seconds: float | None = None) -> records.BenchRecord:
    """A bench's rows as a BenchRecord (versions and time of now filled in)."""
    return records.make(kind, settings, seed, rows, device, seconds)


def merge(parts: Sequence[records.BenchRecord], settings: dict | None = None,
          seconds: float | None = None) -> records.BenchRecord:
    """One record of several runs of one bench (e.g. one per consumer): their rows in order, the
    first one's seed and versions, ``settings`` (default: the first one's) and ``seconds``
    (default: the sum)."""
    if not parts:
        raise ValueError("no record to merge")
    if len({p.kind for p in parts}) > 1:
        raise ValueError(f"records of several kinds cannot be merged: {sorted({p.kind for p in parts})}")
    first = parts[0]
    total = sum(p.seconds or 0.0 for p in parts) if seconds is None else seconds
    return records.BenchRecord(first.kind, first.settings if settings is None else settings, first.seed,
                               [row for p in parts for row in p.rows], first.versions, first.created,
                               seconds=round(total, 1))


def show(table: pd.DataFrame) -> str:
    """A table as the CLI prints it: every column, no index, empty cells for missing values, cells cut at 60
    characters (the record keeps them whole)."""
    if table.empty:
        return "(no rows)"
    return table.to_string(index=False, na_rep="", max_colwidth=60)

"""Every run on the test slice, in the order it was made: the ledger docs/results.md's "test-ledger" table reads.

    python -m research.test_ledger [--out docs/test_ledger.json]

Walks the history of HEAD (``git log``, renames as a deletion and an addition) for each commit that added
or changed a bench record under ``assets/`` (``.json`` or ``.json.gz``), reads that version with ``git show``
and keeps the versions whose settings say they read the test slice (``scdviz.report.slice_of``: a record made
before the slices existed read windows that are in dev now). The versions of one run (the same ``created``:
a record moved, gzipped, relabelled or given a note) are one entry, at the commit that first added
it; a test-slice record in the working tree that no commit holds yet is an entry whose commit is null.

Each entry: ``family`` (SCD for bench scd / ttft records, eviction for bench evict / cost ones), ``kind``,
``record`` (its path at that commit), ``commit`` (short hash), ``date`` (the record's ``created``, else the
commit's date), ``measured`` (SCD: the consumers and what the run added to the lineup; eviction: the policy
and student files it named, or "shipped policies", with its decode tokens and leave-one-domain-out when
set), ``shipped`` (the path holding the run in the working tree, null when no file does) and ``result``,
one line from its rows:

- SCD: per specialist, SCD full (int4 codes + 2 patches; "trained" when the record holds closed-form twins)
  and transform coding at 3,840 B/token against raw KV reuse, mean-KL ratio with the paired-bootstrap 95 %
  interval over passages (as the docs' tables give it); a leave-one-domain-out record gives the range over the
  held-out domains and on how many the interval lies below 1.
- a ``research.specialist_frontier`` record: per candidate, its task F1 over the producer's and raw reuse's over
  the specialist's, with their intervals, and raw reuse's top-1.
- eviction: per mode and kept fraction, the method chosen on validation against the best baseline of that
  mode and budget (ratio and interval, as above); a run that named its policy files (and is not
  leave-one-domain-out) lists every other learned method too, so a variant that lost on test shows.

Written oldest first, as stable JSON (indent 1, sorted keys).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import time
from pathlib import Path

from scdviz import metrics, records, report, settings

OUT = settings.REPO_DIR / "docs" / "test_ledger.json"
FAMILIES = {"scd": "SCD", "ttft": "SCD", "evict": "eviction", "cost": "eviction"}
BUDGET = "SCD transform-coded @3840 B/token"  # the transform-coded row the headline reads
PLAIN_GROUPS = ("method", "token 0", "budget sweep", "patch sweep")  # an SCD lineup's rows every run may hold


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=settings.REPO_DIR, capture_output=True, check=True).stdout


def _parse(data: bytes, path: str) -> records.BenchRecord | None:
    """A record from a file's bytes (gunzipped for ``.gz``); None for a file that is not a bench record."""
    try:
        if path.lower().endswith(".gz"):
            data = gzip.decompress(data)
        return records.from_json(json.loads(data), path)
    except (ValueError, OSError, EOFError):
        return None


def _key(record: records.BenchRecord) -> tuple[str, str]:
    """What makes one run: its kind and its ``created`` (a record relabelled, moved, gzipped or given a note keeps
    it), or, without one, a digest of its rows."""
    return record.kind, record.created or hashlib.sha256(json.dumps(record.rows, sort_keys=True).encode()).hexdigest()


def history() -> list[tuple[str, str, str, records.BenchRecord]]:
    """(short hash, commit date, path, record) of every version of a record under assets/ that a commit of
    HEAD's history added or changed, oldest commit first."""
    log = _git("log", "--reverse", "--no-renames", "--abbrev=7", "--format=%x01%H %h %ct", "--name-status",
               "HEAD", "--", "assets/").decode()
    out = []
    for block in log.split("\x01")[1:]:
        head, *changes = block.strip().splitlines()
        full, short, stamp = head.split()
        date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(stamp)))
        for change in changes:
            status, _, path = change.partition("\t")
            if status not in ("A", "M") or not records.is_record_name(path) or "/adapters/" in path:
                continue
            record = _parse(_git("show", f"{full}:{path}"), path)
            if record is not None:
                out.append((short, date, path, record))
    return out


def working_tree() -> dict[tuple, tuple[str, records.BenchRecord]]:
    """Run key -> (path relative to the checkout, record) of every bench record under assets/ in the working tree."""
    out: dict[tuple, tuple[str, records.BenchRecord]] = {}
    for path in sorted(settings.ASSETS_DIR.rglob("*")):
        if path.is_file() and records.is_record_name(path.name) and "adapters" not in path.parts:
            record = _parse(path.read_bytes(), path.name)
            if record is not None:
                out.setdefault(_key(record), (path.relative_to(settings.REPO_DIR).as_posix(), record))
    return out


# ----------------------------------------------------------------------------- one line per run


def _interval(base: list[float], other: list[float], passages: list | None, against: str = "") -> str:
    """``other``'s mean KL over ``base``'s, ×, then ``against`` and the paired-bootstrap interval over passages."""
    boot = metrics.paired_bootstrap(base, other, clusters=passages or None)
    lo, hi = boot["ratio_ci"]
    return f"{boot['ratio']:.2f}×{' ' + against if against else ''} [{lo:.2f}, {hi:.2f}]"


def _pct(keep: str) -> str:
    return f"{float(keep) * 100:g} %"


def scd_result(record: records.BenchRecord) -> str:
    """Per specialist: SCD full and transform coding at 3,840 B/token over raw KV reuse (see the docstring)."""
    rows = [r for r in record.rows if r.get("row") == "measured" and r.get("kl_per_prompt")]
    name = "SCD (trained)" if any(r["method"].endswith(" (closed form)") for r in rows) else "SCD"
    parts = []
    for spec in dict.fromkeys(r.get("specialist") for r in rows):
        mine = [r for r in rows if r.get("specialist") == spec]
        domains = list(dict.fromkeys(r["domain"] for r in mine))
        shown = []
        for method, label in (("SCD full", f"KL / raw KV's: {name} int4+2p"), (BUDGET, "transform coded @3840")):
            pairs = []
            for dom in domains:
                by = {r["method"]: r for r in mine if r["domain"] == dom}
                if method in by and "raw KV" in by:
                    pairs.append((by["raw KV"], by[method]))
            if len(pairs) == 1:
                raw, r = pairs[0]
                shown.append(f"{label} {_interval(raw['kl_per_prompt'], r['kl_per_prompt'], r.get('passages'))}")
            elif pairs:
                boots = [metrics.paired_bootstrap(raw["kl_per_prompt"], r["kl_per_prompt"],
                                                  clusters=r.get("passages") or None) for raw, r in pairs]
                ratios = [b["ratio"] for b in boots]
                below = sum(b["ratio_ci"][1] < 1 for b in boots)
                shown.append(f"{label} {min(ratios):.2f}–{max(ratios):.2f}× (interval below 1 on {below} of "
                             f"{len(pairs)})")
        if len(domains) == 1:  # QA F1 against raw reuse's; a lineup's extra rows by their best QA F1
            by = {r["method"]: r for r in mine}
            if by.get("SCD full", {}).get("qa_f1") is not None and by.get("raw KV", {}).get("qa_f1") is not None:
                shown.append(f"QA F1 {by['SCD full']['qa_f1']:.3f} vs raw {by['raw KV']['qa_f1']:.3f}")
            for group in dict.fromkeys(r.get("group") for r in mine if r.get("group") not in PLAIN_GROUPS):
                extra = [r for r in mine if r.get("group") == group and r["method"].startswith("SCD")
                         and not r["method"].endswith(" (closed form)") and r.get("qa_f1") is not None]
                if extra and "raw KV" in by:
                    best = max(extra, key=lambda r: r["qa_f1"])
                    kl = _interval(by["raw KV"]["kl_per_prompt"], best["kl_per_prompt"], best.get("passages"))
                    shown.append(f"best QA F1 of its {group} rows: {best['method']} {best['qa_f1']:.3f} at {kl} "
                                 "raw KV's KL")
        if shown:
            what = "per held-out domain" if len(domains) > 1 else "own domain"
            parts.append(f"{spec} ({what}): {', '.join(shown)}")
    return "; ".join(parts) or f"{len(record.rows)} rows"


def _mode(mode: str) -> str:
    """A bench evict mode as the ledger says it: prefill, decode N tokens, or the domain a LODO run left out."""
    rest = mode.removeprefix("agnostic").strip()
    if rest.startswith("decode"):
        return f"decode {rest.removeprefix('decode')}"
    return rest.removeprefix("lodo-") or "prefill"


def evict_result(record: records.BenchRecord) -> str:
    """Per mode and budget: the validation choice (and, see the docstring, other learned methods) against the
    best baseline."""
    rows = [r for r in record.rows if r.get("kl_per_context") and r.get("mode") and r.get("keep")]
    evaluation = record.settings.get("eval") or {}
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    chosen = list(dict.fromkeys(r["method"] for r in rows if r.get("chosen_on_validation")))
    others = [] if not evaluation.get("policies") or evaluation.get("lodo") else list(dict.fromkeys(
        r["method"] for r in rows if r.get("baseline") is False and r["method"] not in chosen))
    groups: dict[str, list[str]] = {}
    for method in chosen + others:
        for r in rows:
            if r["method"] != method or not (r.get("chosen_on_validation") or method in others):
                continue
            at = {o["method"]: o for o in rows if o["mode"] == r["mode"] and o["keep"] == r["keep"]}
            base = at.get(r.get("best_baseline") or "")
            if base is None or base is r:
                continue
            if " lodo-" in r["mode"]:  # the recipe refitted without the domain it is scored on
                name = "retrained without the domain scored"
            else:
                name = method + (" (chosen on validation)" if r.get("chosen_on_validation") else "")
            where = f"{_mode(r['mode'])} " if len(modes) > 1 else ""
            groups.setdefault(name, []).append(f"{where}{_pct(r['keep'])} "
                                               + _interval(base["kl_per_context"], r["kl_per_context"],
                                                           r.get("passages"), r["best_baseline"]))
    return "; ".join(f"{name}: {', '.join(items)}" for name, items in groups.items()) or f"{len(record.rows)} rows"


def measured(record: records.BenchRecord) -> str:
    """What the run measured, in a few words (see the docstring)."""
    s = record.settings
    if record.kind in ("scd", "ttft"):
        bench = s.get("bench") or s.get("ttft") or {}
        words = [", ".join(c.split("=")[-1].removeprefix("builtin:") for c in s.get("consumers") or [])]
        if s.get("research") == "specialist_frontier":
            words.append("task F1 against the producer's (research.specialist_frontier)")
        if bench.get("lodo"):
            words.append("leave-one-domain-out")
        if bench.get("tails"):
            words.append("recomputed tails " + ", ".join(map(str, bench["tails"])))
        if bench.get("raw_layers"):
            words.append("raw layers " + ", ".join(map(str, bench["raw_layers"])))
        return ", ".join(w for w in words if w) or record.kind
    evaluation = s.get("eval") or s.get("cost") or {}
    files = [records.without_suffix(p).removeprefix("assets/policy/").removesuffix(".safetensors")
             for p in evaluation.get("policies") or []]
    words = [", ".join(files) if files else "shipped policies"]
    if (evaluation.get("decode_tokens") or 0) > 0:
        words.append(f"decode {evaluation['decode_tokens']} tokens")
    if evaluation.get("lodo"):
        words.append("leave-one-domain-out")
    return "; ".join(words)


def frontier_result(record: records.BenchRecord) -> str:
    """Per candidate of a ``research.specialist_frontier`` record: its task F1 over the producer's and raw reuse's
    over its own (paired passage-bootstrap intervals), and raw reuse's top-1."""
    parts = []
    for r in record.rows:
        gain, share = (metrics.paired_bootstrap(r[a], r[b], clusters=r["passages"])
                       for a, b in (("qa_f1_producer", "qa_f1_oracle"), ("qa_f1_oracle", "qa_f1_raw")))
        parts.append(f"{r['label']}: task F1 / the producer's {gain['ratio']:.2f}× [{gain['ratio_ci'][0]:.2f}, "
                     f"{gain['ratio_ci'][1]:.2f}], raw reuse's / the specialist's {share['ratio']:.2f}× "
                     f"[{share['ratio_ci'][0]:.2f}, {share['ratio_ci'][1]:.2f}], raw top-1 {r['top1_raw']:.3f}")
    return "; ".join(parts)


def result(record: records.BenchRecord) -> str:
    if record.settings.get("research") == "specialist_frontier":
        return frontier_result(record)
    if record.kind == "scd":
        return scd_result(record)
    if record.kind == "evict":
        return evict_result(record)
    return f"{len(record.rows)} rows"


# ----------------------------------------------------------------------------- the ledger


def ledger() -> list[dict]:
    """Every test-slice run, oldest first (see the module docstring)."""
    shipped = working_tree()
    seen: dict[tuple, dict] = {}
    versions = history() + [(None, None, path, rec) for path, rec in shipped.values()]  # the working tree's last
    for short, date, path, rec in versions:
        if report.slice_of(rec) != "test" or _key(rec) in seen:
            continue
        seen[_key(rec)] = {"family": FAMILIES[rec.kind], "kind": rec.kind, "record": path, "commit": short,
                           "date": rec.created or date or "", "measured": measured(rec),
                           "shipped": shipped[_key(rec)][0] if _key(rec) in shipped else None,
                           "result": result(rec)}
    return sorted(seen.values(), key=lambda e: (e["date"], e["record"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m research.test_ledger", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT), help="where to write the ledger (default: %(default)s)")
    args = parser.parse_args(argv)
    entries = ledger()
    Path(args.out).write_text(json.dumps(entries, indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                              encoding="utf-8")
    for i, e in enumerate(entries, 1):
        print(f"{i:3} {e['date']} {e['commit'] or 'uncommitted'} {e['record']}: {e['result']}")
    print(f"{len(entries)} test-slice runs -> {args.out}")


if __name__ == "__main__":
    main()

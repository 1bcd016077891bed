"""Results tables for the docs, rendered from the shipped benchmark records.

``python -m scdviz report`` rewrites every marked block of ``README.md`` and ``docs/**/*.md``::

    <!-- table:NAME -->
    ...                      (written by this module; do not edit by hand)
    <!-- /table:NAME -->

with the table ``NAME`` of ``TABLES`` rendered from the records under ``assets/``;
``python -m scdviz report --check`` writes nothing and exits 1 listing each block that differs
from what the records give. So a number in a docs table cannot drift from its record. Every
table ends with a line naming its record file(s) and the command that made each record (the
``.toml`` beside it when one holds the record's settings, else the flags rebuilt from the
record's settings). One table is not a record's: ``test-ledger`` lists every run on the test slice from
``docs/test_ledger.json``, which ``python -m research.test_ledger`` writes from the git history.

Library layer: imports records and config (no torch) and reads nothing at import; the paired
bootstrap intervals are the benches' own (``scdviz.metrics``, imported when a table needs one),
so an interval here is the one the bench prints.
"""

from __future__ import annotations

import functools
import json
import math
import re
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

from scdviz import config, records, settings
from scdviz.serving import table as serving_table

SPECIALISTS = ("jargon", "austen-before")  # the shipped SCD specialists, in the docs' order
KEEPS = ("0.25", "0.125")  # the eviction protocol's kept fractions

# the settings of a research probe's record that are its flags
RESEARCH_FLAGS = ("per_domain", "seeds", "consumer", "calib", "calibs", "consumers", "domain", "limit", "other_limit",
                  "budgets")
BLOCK = re.compile(r"(<!-- table:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)


# ----------------------------------------------------------------------------- records and commands


def shown_path(path: Path) -> str:
    """A record's path as the docs name it: relative to the folder holding ``assets/``."""
    path = Path(path).resolve()
    try:
        return path.relative_to(settings.ASSETS_DIR.resolve().parent).as_posix()
    except ValueError:
        return path.name


@functools.cache
def shipped_record(rel: str) -> records.BenchRecord:
    """A shipped record by its path under assets/ (``scd/jargon/bench.json``), read once per process
    (every table and source line names its records again; the tables only read them)."""
    return records.read(settings.ASSETS_DIR / rel)


def _flat(settings_: dict, prefix: str = "") -> dict:
    """Nested settings as {field: value}, output fields and None left out (as a saved config.toml)."""
    out = {}
    for key, value in settings_.items():
        if isinstance(value, dict):
            out.update(_flat(value, prefix))
        elif key not in config.OUTPUT_FIELDS and value is not None:  # where a run writes, not what it measures
            out[key] = value
    return out


def _same_settings(a: dict, b: dict) -> bool:
    """Equal settings; a folder counts as the same when only where the runs folder lies differs
    (a shipped config names it ``<your runs folder>/calibrations/NAME``, the record ``runs/calibrations/NAME``)."""
    def norm(v):
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        if isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, str) and "/" in v:
            return "/".join(v.rstrip("/").split("/")[-2:])
        return v
    return a.keys() == b.keys() and all(norm(a[k]) == norm(b[k]) for k in a)


def _flag_value(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _cli_defaults(kind: str) -> dict[str, tuple[str, object]]:
    """{field: (flag, default)} of ``bench KIND``'s settings, from the CLI's own dataclasses."""
    from scdviz import commands  # lazily: the command settings import every bench (and torch)

    return config.flags(commands.BENCHES[kind])


def _live(settings_: dict) -> dict:
    """Nested settings without those the CLI has retired (``commands.RETIRED_SETTINGS``, dotted paths): an
    older record still carries them, its shipped config no longer does."""
    from scdviz import commands

    out = {k: dict(v) if isinstance(v, dict) else v for k, v in settings_.items()}
    for dotted in commands.RETIRED_SETTINGS:
        table, _, key = dotted.rpartition(".")
        if isinstance(out.get(table), dict):
            out[table].pop(key, None)
    return out


def command(path: Path, record: records.BenchRecord) -> str:
    """The command that made ``record``: ``bench KIND --config TOML`` when a .toml beside it holds
    exactly its settings, else ``bench KIND`` with the flags whose values differ from the CLI's defaults."""
    if "research" in record.settings:  # a probe's record: its module and flags
        flags = " ".join(f"--{k.replace('_', '-')} {' '.join(map(_flag_value, v)) if isinstance(v, list) else v}"
                         for k, v in record.settings.items() if k in RESEARCH_FLAGS and v not in (None, ""))
        if record.settings.get("slice") not in (None, "dev"):  # the probes read dev unless told
            flags += f" --slice {record.settings['slice']}"
        return f"python -m research.{record.settings['research']} {flags} --out {Path(path).name}"
    mine = _flat(_live(record.settings))
    for toml in sorted(Path(path).parent.glob("*.toml"), key=lambda p: p.stem != records.stem(path)):
        if _same_settings(mine, _flat(_live(tomllib.loads(toml.read_text())))):
            return f"python -m scdviz bench {record.kind} --config {shown_path(toml)}"
    defaults = _cli_defaults(record.kind)
    parts = [f"python -m scdviz bench {record.kind}"]
    for key, value in _flat(record.settings).items():
        if key not in defaults:
            continue  # a setting the CLI no longer has (its default then)
        flag, default = defaults[key]
        if _same_settings({key: value}, {key: default}):
            continue
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            parts.append(" ".join([flag, *map(_flag_value, value)]))
        else:
            parts.append(f"{flag} {_flag_value(value)}")
    parts.append(f"--out {Path(path).name}")
    return " ".join(parts)


def slice_of(record: records.BenchRecord) -> str | None:
    """The eval slice a record read (``scdviz.data``: dev or test), None for a record made before the
    slices existed (it read the opening windows of each eval split, which are now in dev)."""
    for part in ("bench", "eval", "cost", "ttft"):
        if isinstance(record.settings.get(part), dict) and "slice" in record.settings[part]:
            return record.settings[part]["slice"]
    return record.settings.get("slice")  # a research probe's record


SLICE_WORDS = {"test": "test slice", "dev": "dev slice",
               None: "read before the dev/test slices; its windows are in dev now"}


def _source_line(rels: Sequence[str]) -> str:
    made = "; ".join(f"`{shown_path(settings.ASSETS_DIR / r)}` ({SLICE_WORDS[slice_of(shipped_record(r))]}): "
                     f"`{command(settings.ASSETS_DIR / r, shipped_record(r))}`" for r in rels)
    return f"*Records (and the command that made each):* {made}."


# ----------------------------------------------------------------------------- formatting


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _f(x, nd: int = 4) -> str:
    return "" if x is None else f"{x:.{nd}f}"


def _b(x) -> str:
    return "" if x is None else f"{round(x):,}"


def _ci(lo: float, hi: float, nd: int = 2, sign: bool = False) -> str:
    fmt = f"{{:{'+' if sign else ''}.{nd}f}}"
    return f"[{fmt.format(lo)}, {fmt.format(hi)}]"


def _protocol():
    """scdviz.protocol, imported on first use (its intervals need torch)."""
    from scdviz import protocol

    return protocol


def paired_bootstrap(a: list[float], b: list[float], clusters: list[str] | None = None) -> dict:
    """The benches' paired bootstrap (b against a over paired items, whole passages when ``clusters``
    are given): diff, ratio and their 95% intervals."""
    from scdviz import metrics  # lazily: torch

    return metrics.paired_bootstrap(a, b, clusters=clusters)


def _boot_mean(values: list[float], clusters: list[str] | None = None) -> dict:
    from scdviz import metrics

    return metrics.bootstrap_mean(values, clusters=clusters)


def passages_of(row: dict) -> list[str] | None:
    """The passage of each item of a record row (the cluster bootstrap's clusters); None in records made
    before rows carried them (their intervals resample items)."""
    return row.get("passages") or None


def _ratio(base: dict, other: dict, key: str = "kl_per_prompt") -> str:
    """``other``'s mean KL over ``base``'s, ×, with the paired-bootstrap interval."""
    boot = paired_bootstrap(base[key], other[key], passages_of(other))
    return f"{other['kl'] / base['kl']:.2f}× {_ci(*boot['ratio_ci'])}"


def _pct(keep: str) -> str:
    return f"{float(keep) * 100:g} %"


# ----------------------------------------------------------------------------- SCD tables

SCD_NAMES = {"SCD full": "**SCD**", "DroidSpeak recompute": "DroidSpeak (2 layers)"}


def _with_record(name: str) -> tuple[list[str], list[str]]:
    """The shipped specialists that have the record ``scd/<specialist>/<name>`` and those records' paths (a
    specialist shipped later than a run was made appears in that run's tables once its own record is)."""
    specs = [s for s in SPECIALISTS if (settings.ASSETS_DIR / "scd" / s / name).is_file()]
    return specs, [f"scd/{s}/{name}" for s in specs]


def _scd_rows(rel: str, group: str, domain: str | None = None) -> list[dict]:
    return [r for r in shipped_record(rel).rows if r.get("row") == "measured" and r.get("group") == group
            and (domain is None or r["domain"] == domain)]


def scd_own() -> str:
    """Each specialist's own domain, test slice: every method and baseline, with continuation perplexity."""
    specs, rels = _with_record("test.json")
    out = []
    for rel, spec in zip(rels, specs, strict=True):
        for group in ("method", "token 0"):
            rows = _scd_rows(rel, group)
            if not rows:  # a run without the other token-0 handling (--no-sent-rows)
                continue
            raw = next(r for r in rows if r["method"].startswith("raw KV"))
            for r in rows:
                if r["method"] == "oracle" and group == "token 0":
                    continue
                out.append([spec, SCD_NAMES.get(r["method"], r["method"]), _b(r["payload_bytes_per_token"]),
                            f"{r['kl']:.4f} ± {r['kl_se']:.4f}",
                            "" if r["method"] == "oracle" or r is raw else _ratio(raw, r),
                            f"{r['top1']:.3f}", f"{r['ppl']:.2f}", _f(r.get("f1_vs_oracle"), 2),
                            _f(r.get("qa_f1"), 3), f"{r['speedup_vs_oracle_10gbps']:.1f}×"])
    head = ["specialist", "method", "bytes/token", "KL ± se", "KL / raw KV [95% CI]", "top-1",
            "continuation perplexity", "F1 vs oracle", "QA F1", "speed-up at 10 Gbit/s (modelled)"]
    return _table(head, out) + "\n\n" + _source_line(rels)


def scd_budget() -> str:
    """The budget sweep: each way of meeting a byte budget, real bytes, KL relative to raw reuse."""
    specs, rels = _with_record("bench.json")
    out = []
    for rel, spec in zip(rels, specs, strict=True):
        raw = next(r for r in _scd_rows(rel, "method") if r["method"] == "raw KV")
        for r in _scd_rows(rel, "budget sweep"):
            name, budget = r["method"].rsplit(" @", 1)
            budget = float(budget.split()[0])
            label = {"SCD transform-coded": "**transform coded**", "SCD RD": "rate-distortion",
                     "SCD RD+entropy": "rate-distortion + entropy", "SCD rank-only": "rank-only"}.get(name, name)
            out.append([spec, f"{budget:,.0f} (1/{23040 / budget:.0f} of fp16)", label,
                        _b(r["payload_bytes_per_token"]), f"{r['kl']:.4f} ± {r['kl_se']:.4f}", _ratio(raw, r),
                        f"{r['top1']:.3f}", f"{r['ppl']:.2f}"])
    head = ["specialist", "budget, B/token", "method", "real B/token", "KL ± se", "KL / raw KV [95% CI]", "top-1",
            "continuation perplexity"]
    return _table(head, out) + "\n\n" + _source_line(rels)


def scd_patch() -> str:
    """PATCH: KL at k patch layers relative to k = 0 (reuse-only), greedy placement and by drift."""
    specs, rels = _with_record("bench.json")
    out = []
    for rel, spec in zip(rels, specs, strict=True):
        sweep = _scd_rows(rel, "patch sweep")
        for placement in ("greedy", "drift"):
            rows = [r for r in sweep if r["method"].endswith(f"({placement})")]
            base = rows[0]
            for r in rows[1:]:
                k = int(r["method"].split("k=")[1].split()[0])
                b = paired_bootstrap(base["kl_per_prompt"], r["kl_per_prompt"], passages_of(r))
                out.append([spec, "greedy order" if placement == "greedy" else "by drift", str(k),
                            _b(r["payload_bytes_per_token"]), f"{r['kl']:.4f}",
                            f"{b['ratio']:.3f} " + _ci(*b["ratio_ci"], 3),
                            f"{r['top1']:.3f}"])
    head = ["specialist", "placement", "k patches", "bytes/token", "KL", "KL / k = 0 [95% CI]", "top-1"]
    return _table(head, out) + "\n\n" + _source_line(rels)


def scd_lodo(record: str = "lodo_test.json.gz") -> str:
    """Leave-one-domain-out (test slice): per held-out domain, raw reuse vs SCD (int4 operating point and
    transform coded)."""
    specs, rels = _with_record(record)
    out = []
    for rel, spec in zip(rels, specs, strict=True):
        rows = _scd_rows(rel, "method")
        for dom in dict.fromkeys(r["domain"] for r in rows):
            by = {r["method"]: r for r in rows if r["domain"] == dom}
            raw, scd = by["raw KV"], by["SCD full"]
            tc = next(r for r in _scd_rows(rel, "budget sweep", dom) if r["method"].startswith("SCD transform-coded"))
            above = sum(s > r for s, r in zip(scd["kl_per_prompt"], raw["kl_per_prompt"], strict=True))
            out.append([spec, dom + (" (own)" if dom == _own_domain(spec) else ""),
                        f"{raw['kl']:.4f} ± {raw['kl_se']:.4f}", f"{scd['kl']:.4f} ± {scd['kl_se']:.4f}",
                        _ratio(raw, scd), f"{raw['top1']:.3f} → {scd['top1']:.3f}",
                        f"{above} of {scd['n_prompts']}", _b(scd["payload_bytes_per_token"]),
                        _ratio(raw, tc), _b(tc["payload_bytes_per_token"]), f"{tc['top1']:.3f}",
                        f"{by['4-bit KV']['kl'] / raw['kl']:.2f}×",
                        f"{scd['ppl_oracle']:.1f} / {raw['ppl']:.1f} / {scd['ppl']:.1f}"])
    head = ["specialist", "held-out domain", "raw KV KL ± se", "SCD KL ± se", "SCD / raw [95% CI]",
            "top-1 raw → SCD", "prompts SCD > raw", "SCD B/token", "transform coded / raw [95% CI]",
            "its B/token", "its top-1", "4-bit KV / raw", "perplexity: oracle / raw / SCD"]
    return _table(head, out) + "\n\n" + _source_line(rels)


def _own_domain(spec: str) -> str:
    return spec.split("-")[0]


def scd_qa(record: str = "lodo_test.json.gz") -> str:
    """Context-QA token-F1 pooled over the six held-out domains of the leave-one-domain-out runs (test slice)."""
    specs, rels = _with_record(record)
    out = []
    for rel, spec in zip(rels, specs, strict=True):
        items: dict[str, list[float]] = {}
        groups: dict[str, list[str]] = {}
        for r in _scd_rows(rel, "method"):
            items.setdefault(r["method"], []).extend(r["qa_f1_items"])
            groups.setdefault(r["method"], []).extend(passages_of(r) or [])
        clusters = groups["raw KV"] if len(groups["raw KV"]) == len(items["raw KV"]) else None
        own = {m: _boot_mean(v, clusters) for m, v in items.items()}
        vs = paired_bootstrap(items["raw KV"], items["SCD full"], clusters)
        out.append([spec, str(len(items["raw KV"]))]
                   + [f"{own[m]['mean']:.3f}" for m in ("oracle", "raw KV", "4-bit KV", "DroidSpeak recompute")]
                   + [f"{own['SCD full']['mean']:.3f} {_ci(*own['SCD full']['ci'], 3)}",
                      f"{vs['diff']:+.3f} {_ci(*vs['diff_ci'], 3, sign=True)}"])
    head = ["specialist", "items", "oracle", "raw KV", "4-bit KV", "DroidSpeak",
            "SCD full, closed form calibrated without the domain [95% CI]", "SCD − raw (paired) [95% CI]"]
    return _table(head, out) + "\n\n" + _source_line(rels)


def _qa_vs_raw(raw: dict, row: dict) -> str:
    """A row's context-QA token-F1 less raw reuse's, paired over items (passages resampled), with its interval."""
    if row is raw:
        return ""
    qa = paired_bootstrap(raw["qa_f1_items"], row["qa_f1_items"], passages_of(row))
    return f"{qa['diff']:+.3f} {_ci(*qa['diff_ci'], 3, sign=True)}"


def scd_tail(record: str = "tail_test.json.gz") -> str:
    """A recomputed tail (test slice): raw KV, SCD reuse-only and transform coded at 3,840 B/token, each without
    and with the consumer recomputing the prompt's last tokens, beside DroidSpeak's 2 recomputed layers: KL
    against raw reuse and against the same method without the tail, the consumer's compute, QA."""
    from scdviz.scd.plan import base_name  # lazily, as the commands: plans import torch

    specs, rels = _with_record(record)
    out = []
    for rel, spec in zip(rels, specs, strict=True):
        plain = {r["method"]: r for r in _scd_rows(rel, "method") + _scd_rows(rel, "budget sweep")}
        raw = plain["raw KV"]
        tc = next(m for m in plain if m.startswith("SCD transform-coded") and not m.endswith(")"))
        shown = [plain[m] for m in ("raw KV", "DroidSpeak recompute", "SCD reuse-only", tc)]
        for r in shown + _scd_rows(rel, "tail sweep"):
            base = plain.get(base_name(r["method"]))
            out.append([spec, SCD_NAMES.get(r["method"], r["method"]), str(r.get("tail", 0)),
                        f"{r['prefill_share']:.1%}" if "prefill_share" in r else "",
                        _b(r["payload_bytes_per_token"]), f"{r['kl']:.4f}", "" if r is raw else _ratio(raw, r),
                        _ratio(base, r) if base is not None and base is not r else "", f"{r['top1']:.3f}",
                        _f(r.get("qa_f1"), 3), _qa_vs_raw(raw, r)])
    head = ["specialist", "method", "tail (tokens)", "consumer compute (share of its prefill)", "bytes/token", "KL",
            "KL / raw KV [95% CI]", "KL / without the tail [95% CI]", "top-1", "QA F1", "QA − raw (paired) [95% CI]"]
    return _table(head, out) + "\n\n" + _source_line(rels)


DISTIL_SCALE = ("scd/distil_scale_dev.json", "scd/distil_scale_dev_jargon.json")  # austen-qkv (retired), jargon


def scd_distil_scale(rels: tuple[str, ...] = DISTIL_SCALE) -> str:
    """The correction stage trained on more windows (dev slice): each specialist's arms at each trained plan beside
    raw KV and the closed form on the same prompts, per scope of text, with paired passage-bootstrap intervals
    (``research.distil_scale``; its first trained arm, 1x, is the one the others are compared with)."""
    out = []
    for rel in rels:
        record = shipped_record(rel)
        rows, who = record.rows, record.settings["consumer"].removeprefix("builtin:")
        arms = list(dict.fromkeys(r["arm"] for r in rows if r["arm"] not in ("raw KV", "closed form")))
        if arms[0] != "1x":
            raise ValueError(f"{rel}: its first trained arm is {arms[0]!r}; this table compares with 1x")
        for scope in dict.fromkeys(r["scope"] for r in rows):
            mine = [r for r in rows if r["scope"] == scope]
            raw = next(r for r in mine if r["arm"] == "raw KV")
            closed = {r["method"]: r for r in mine if r["arm"] == "closed form"}
            first = {r["method"]: r for r in mine if r["arm"] == arms[0]}
            for r in mine:
                t = r.get("training") or {}
                windows = f"{t['train_windows']:,} / {t['val_windows']}" if t.get("train_windows") else ""
                kept = f"{t['best_step']:,} of {t['val_steps'][-1]:,}" if t.get("val_steps") else ""
                trained = r["arm"] not in ("raw KV", "closed form")
                out.append([f"{who}: {scope} ({len(r['kl_per_prompt'])})", r["arm"], windows, kept,
                            r["method"], _f(r["kl"], 5), _ratio(raw, r) if r is not raw else "1",
                            _ratio(closed[r["method"]], r) if trained else "",
                            _ratio(first[r["method"]], r) if r["arm"] in arms[1:] else "", _f(r["top1"], 3),
                            _f(r["qa_f1_mean"], 3)])
    head = ["specialist: text (prompts)", "arm", "training / validation windows", "kept at step", "plan", "KL",
            "× raw KV", "× closed form", "× 1x", "top-1", "QA F1"]
    return _table(head, out) + "\n\n" + _source_line(list(rels))


FRONTIER = "scd/specialist_frontier_dev.json"  # issue 62's candidate specialists, dev slice
RAW_LINE = {"share": 0.6, "top1": 0.6, "gain": 1.2, "recovered": 0.8}  # issue 62's lines (raw reuse, gain, SCD)


def scd_frontier(rel: str = FRONTIER) -> str:
    """Candidate specialists on the frontier of raw reuse's damage × the specialist's gain over the producer, on
    their task's eval windows (``research.specialist_frontier``): each one's task F1 for the producer, the specialist
    (its own cache) and raw reuse (the producer's cache), the gain and raw reuse's share with paired
    passage-bootstrap intervals, raw reuse's top-1 and KL on the continuation, the continuation's perplexity, and
    whether it reaches the raw-reuse line (share ≤ 0.6, top-1 ≤ 0.6, gain ≥ 1.2), flagged when the specialist's
    perplexity is over twice the producer's (it no longer models the text the continuation lines are measured on)."""
    out = []
    for r in shipped_record(rel).rows:
        cfg, clusters = r["recipe"].get("config", {}), r["passages"]
        gain = paired_bootstrap(r["qa_f1_producer"], r["qa_f1_oracle"], clusters)
        share = paired_bootstrap(r["qa_f1_oracle"], r["qa_f1_raw"], clusters)
        reaches = (share["ratio"] <= RAW_LINE["share"] and r["top1_raw"] <= RAW_LINE["top1"]
                   and gain["ratio"] >= RAW_LINE["gain"])
        targets = cfg.get("targets") or ["every linear"]  # jargon's log predates --targets: its default, all seven
        where = _layer_span(cfg.get("layers") or [])
        adapter = (f"{' '.join(t.removesuffix('_proj') for t in targets)}{where}, rank {cfg.get('rank')}, "
                   f"lr {cfg.get('lr')}, {cfg.get('steps')} steps; {r['recipe'].get('adapter_bytes', 0) / 1e6:.1f} MB")
        mean = {k: sum(r[k]) / len(r[k]) for k in ("qa_f1_producer", "qa_f1_oracle", "qa_f1_raw")}
        weight = float(cfg.get("text_loss") or 0)  # older logs say true: a weight of 1
        task = cfg.get("task", "text") + (" + its text" if weight == 1 else f" + its text × {weight:g}" if weight
                                          else "")
        out.append([f"{r['label']} ({len(clusters)})", f"{task} on {cfg.get('corpus')}",
                    adapter, r["question"], " / ".join(_f(mean[k], 3) for k in mean),
                    f"{gain['ratio']:.2f}× {_ci(*gain['ratio_ci'])}",
                    f"{share['ratio']:.2f}× {_ci(*share['ratio_ci'])}",
                    _f(r["top1_raw"], 3), _f(r["kl_raw_mean"], 4),
                    " / ".join(f"{r[k]:.1f}" for k in ("ppl_producer", "ppl_oracle", "ppl_raw")),
                    ("no" if not reaches else "yes" if r["ppl_oracle"] <= 2 * r["ppl_producer"]
                     else "yes, but the specialist no longer models the text")])
    head = ["candidate (prompts)", "trained on", "adapter", "question asked", "task F1: producer / specialist / raw",
            "specialist ÷ producer", "raw ÷ specialist", "raw top-1", "raw KL",
            "continuation PPL: producer / specialist / raw", "reaches the raw-reuse line"]
    return _table(head, out) + "\n\n" + _source_line([rel])


TASK_SPECIALIST = "austen-before"  # issue 62's built-in specialist: its test records
TASK_FRONTIER = "scd/specialist_frontier_test.json"  # its producer's task F1 on the same test windows


def _share(oracle: dict, row: dict) -> dict:
    """``row``'s task F1 over the oracle's, paired over items (passages resampled)."""
    return paired_bootstrap(oracle["qa_f1_items"], row["qa_f1_items"], passages_of(row))


def scd_task(spec: str = TASK_SPECIALIST, frontier: str = TASK_FRONTIER) -> str:
    """The task specialist on its own domain's test slice, in the seeds' terms: every method's task F1 and its share
    of the oracle's, top-1 and KL against raw reuse (its SCD test record), then issue 62's lines, each measured with
    its paired passage-bootstrap interval: raw reuse's share ≤ 0.6 and top-1 ≤ 0.6, the specialist ≥ 1.2× the
    producer (the frontier record, same windows and question), SCD at ≤ 3,840 B/token ≥ 0.8× the oracle, and PATCH
    (SCD full against the same plan without patches, SCD reuse-only) lowering KL. Every trained SCD plan the record
    holds at ≤ 3,840 B/token gets its line (none is picked after the fact)."""
    rel = f"scd/{spec}/test.json"
    rows = _scd_rows(rel, "method") + _scd_rows(rel, "budget sweep")
    by = {r["method"]: r for r in rows}
    oracle, raw = by["oracle"], by["raw KV"]
    out = []
    for r in rows:
        share = _share(oracle, r)
        out.append([SCD_NAMES.get(r["method"], r["method"]), _b(r["payload_bytes_per_token"]), _f(r["qa_f1"], 3),
                    "1" if r is oracle else f"{share['ratio']:.2f}× {_ci(*share['ratio_ci'])}", f"{r['top1']:.3f}",
                    f"{r['kl']:.4f}", "" if r in (oracle, raw) else _ratio(raw, r)])
    head = ["method", "bytes/token", "task F1", "of the oracle's [95% CI]", "top-1", "KL", "KL / raw KV [95% CI]"]
    first = _table(head, out)

    (fr,) = [r for r in shipped_record(frontier).rows if r["consumer"] == f"builtin:{spec}"]
    if fr["qa_f1_oracle"] != oracle["qa_f1_items"]:
        raise ValueError(f"{frontier} and {rel} answered on different items: their oracle F1 differ")
    gain = paired_bootstrap(fr["qa_f1_producer"], fr["qa_f1_oracle"], fr["passages"])
    coded = [r for r in rows if r["method"].startswith("SCD") and "closed form" not in r["method"]
             and r["payload_bytes_per_token"] <= 3840]
    patch = paired_bootstrap(by["SCD reuse-only"]["kl_per_prompt"], by["SCD full"]["kl_per_prompt"],
                             passages_of(by["SCD full"]))
    raw_share = _share(oracle, raw)

    def mean(xs):
        return sum(xs) / len(xs)

    def line(what, value, ci, bar, met):
        shown = f"{value:.2f}× {_ci(*ci)}" if ci else f"{value:.3f}"
        return [what, shown, bar, "yes" if met else "**no**"]

    lines = [line("raw reuse's task F1 ÷ the oracle's", raw_share["ratio"], raw_share["ratio_ci"], "≤ 0.6",
                  raw_share["ratio"] <= RAW_LINE["share"]),
             line("raw reuse's top-1", raw["top1"], None, "≤ 0.6", raw["top1"] <= RAW_LINE["top1"]),
             line(f"the specialist's task F1 ÷ the producer's ({_f(mean(fr['qa_f1_producer']), 3)})", gain["ratio"],
                  gain["ratio_ci"], "≥ 1.2", gain["ratio"] >= RAW_LINE["gain"])]
    for r in coded:
        s = _share(oracle, r)
        lines.append(line(f"{r['method']} ({_b(r['payload_bytes_per_token'])} B/token), task F1 ÷ the oracle's",
                          s["ratio"], s["ratio_ci"], "≥ 0.8", s["ratio"] >= RAW_LINE["recovered"]))
    lines.append(line("PATCH: SCD full's KL ÷ SCD reuse-only's (the same plan without patches)", patch["ratio"],
                      patch["ratio_ci"], "interval below 1", patch["ratio_ci"][1] < 1))
    second = _table(["line (issue 62)", "measured [95% CI]", "needs", "met"], lines)
    return first + "\n\n" + second + "\n\n" + _source_line([rel, frontier])


DEPTH_AFTER = (4, 9, 14, 15, 17, 20, 23, 26, 29)  # layers after which the error-through-depth table reads


def scd_depth(spec: str = TASK_SPECIALIST) -> str:
    """Error through depth on the task specialist's test record, as the SCD tab's error-accumulation plot draws it:
    the relative error of the continuation's hidden state against the oracle's after each of ``DEPTH_AFTER``'s
    layers (the record's ``divergence``, mean over prompts), per method, with the layers each one patches."""
    rel = f"scd/{spec}/test.json"
    rows = [r for r in _scd_rows(rel, "method") if r["method"] != "oracle"]
    out = []
    for r in rows:
        patched = [i for i, m in enumerate(r["modes"]) if m == "patch"]
        out.append([SCD_NAMES.get(r["method"], r["method"]), " ".join(map(str, patched)) or "none"]
                   + [f"{r['divergence'][layer + 1]:.3f}" for layer in DEPTH_AFTER])
    head = ["method", "patch layers"] + [f"after layer {layer}" for layer in DEPTH_AFTER]
    return _table(head, out) + "\n\n" + _source_line([rel])


def _layer_span(layers: list[int]) -> str:
    """" in layers 15–29" for a run of layers, " in layers 3 7" otherwise; "" for every layer (an empty list)."""
    if not layers:
        return ""
    if layers == list(range(min(layers), max(layers) + 1)):
        return f" in layers {min(layers)}–{max(layers)}"
    return " in layers " + " ".join(map(str, layers))


TASK_LAYERS = ("scd/task_layers_dev.json", "scd/task_layers_scd_dev.json")  # issue 62: raw and SCD bases, dev


def scd_task_layers(rels: tuple[str, ...] = TASK_LAYERS) -> str:
    """Where a specialist's task reads the cache (``research.task_layers``): its task F1 from a base cache (raw reuse,
    SCD's operating plan) with its own K, V swapped into each layer set, and the share of the oracle's F1 that keeps
    (paired passage-bootstrap interval), one column pair per base."""
    rows = [shipped_record(rel).rows[0] for rel in rels]
    sets = list(rows[0]["qa_f1"])
    out = []
    for label in sets:
        line = [label]
        for r in rows:
            items = r["qa_f1"][label]
            share = paired_bootstrap(r["qa_f1"]["oracle"], items, r["passages"])
            line += [_f(sum(items) / len(items), 3),
                     f"{share['ratio']:.2f}× {_ci(*share['ratio_ci'])}" if label != "oracle" else "1"]
        out.append(line)
    head = ["its own K, V in layers"]
    for r in rows:
        head += [f"task F1, base {r['base']} ({r['consumer'].split('/')[-1]}, {len(r['passages'])})",
                 "of the oracle's"]
    return _table(head, out) + "\n\n" + _source_line(list(rels))


def scd_ttft() -> str:
    """Time to first token, measured (medians of interleaved rounds), each specialist's trained stage with its
    closed form in the same rounds."""
    specs, rels = _with_record("ttft_receive.json")
    return "\n\n".join(_ttft_one(rel, spec) for rel, spec in zip(rels, specs, strict=True)) + "\n\n" + \
        _source_line(rels)


def _ttft_one(rel: str, spec: str) -> str:
    rows = shipped_record(rel).rows
    out = [[r["method"], _b(r["bytes_per_token"]),
            f"{round(r['encode_ms'] + r['receive_ms'] + r['first_step_ms']):,} {r['compute_iqr_ms']}",
            f"{round(r['encode_ms']):,} / {round(r['receive_ms']):,}",
            f"{round(r['ttft_10gbps_ms']):,} / {round(r['ttft_with_prefill_10gbps_ms']):,} / "
            f"{round(r['ttft_shared4_10gbps_ms']):,}",
            f"{_f(r['break_even_gbps'], 3)} / {_f(r['break_even_shared4_gbps'], 3)}",
            _f(r.get("receive_vs_closed_form"), 3)] for r in rows
           if r.get("encode_ms") is not None]
    head = ["method", "B/token", "consumer + encode, median [IQR] ms", "encode / receive ms",
            "TTFT at 10 Gbit/s, ms: no producer prefill / with it / shared by 4",
            "break-even Gbit/s (no prefill / shared by 4)", "receive / closed form's"]
    first = rows[0]
    return (f"**{spec}**\n\n" + _table(head, out) + "\n\nOracle (the consumer's own prefill + first step): "
            f"{round(first['oracle_ms']):,} ms; the producer's prefill: {round(first['producer_prefill_ms']):,} ms.")


# ----------------------------------------------------------------------------- eviction tables


def _joined(rels: list[str], mode: str = "agnostic") -> dict[tuple[str, str], dict]:
    """(method, keep) -> row over records made on the same contexts; the first record's row wins, and a
    method two records share must agree per context (to another machine's float rounding)."""
    out: dict[tuple[str, str], dict] = {}
    for rel in rels:
        for row in shipped_record(rel).rows:
            if row.get("mode") != mode or "kl_per_context" not in row:
                continue
            key = (row["method"], row["keep"])
            if key in out:
                a, b = out[key]["kl_per_context"], row["kl_per_context"]
                if len(a) != len(b) or any(abs(x - y) > 1e-4 + 1e-3 * abs(y) for x, y in zip(a, b, strict=True)):
                    raise ValueError(f"{rel}: {key} differs per context from the record before: not the same contexts")
            out.setdefault(key, row)
    return out


def _vs_best(rels: list[str], mode: str = "agnostic", learned_only: bool = False) -> list[list[str]]:
    rows = _joined(rels, mode)
    out = []
    for keep in KEEPS:
        at = {m: r for (m, k), r in rows.items() if k == keep}
        base = {m: r for m, r in at.items() if r.get("baseline")}
        best = min(base, key=lambda m: base[m]["kl"])
        n = len(base[best]["kl_per_context"])
        ctx_best = [min(r["kl_per_context"][i] for r in base.values()) for i in range(n)]
        for m, r in sorted(at.items(), key=lambda kv: kv[1]["kl"]):
            if learned_only and r.get("baseline") and m != best:
                continue
            name = m + (" *" if r.get("chosen_on_validation") else "") + (" (best baseline)" if m == best else "")
            if m == best:
                cells = ["", "", "", ""]
            else:
                versus = _protocol().vs_best({best: base[best]["kl_per_context"], m: r["kl_per_context"]}, m, [best],
                                             clusters=passages_of(r))
                boot, b = versus["boot"], r["kl_per_context"]
                wins_ctx = ("" if r.get("baseline") else
                            f"{sum(y < x for x, y in zip(ctx_best, b, strict=True)) / n:.2f}")
                cells = [f"{boot['ratio']:.2f} {_ci(*boot['ratio_ci'])}",
                         f"{boot['diff']:+.4f} {_ci(*boot['diff_ci'], 4, sign=True)}", f"{versus['wins']:.2f}",
                         wins_ctx]
            out.append([_pct(keep), name, f"{r['kl']:.4f} ± {r['kl_se']:.4f}", *cells, f"{r['top1']:.3f}",
                        f"{r['ppl']:.2f}", _f(r.get("qa_acc"), 2)])
    return out


VS_BEST_HEAD = ["kept", "method", "KL ± se", "/ best baseline [95% CI]", "− best baseline [95% CI]", "wins vs best",
                "wins vs each context's best baseline", "top-1", "continuation perplexity", "QA acc."]
PROTOCOL = ["policy/bench/test.json"]  # the eviction protocol on the test slice (natives included)
# the shipped headline (the student, chosen on validation) first, then the protocol record beside it (the same 66
# contexts; its chosen policy, the lookahead, is the expensive reference)
HEADLINE_PROTOCOL = ["policy/bench/student_window_test.json", *PROTOCOL]


def evict_headline() -> str:
    """The eviction protocol (66 contexts): every learned policy and the best baseline at each kept fraction."""
    return (_table(VS_BEST_HEAD, _vs_best(HEADLINE_PROTOCOL, learned_only=True)) + "\n\n"
            + _source_line(HEADLINE_PROTOCOL))


def evict_protocol() -> str:
    """The eviction protocol (66 contexts): every method, kvpress's native presses joined from the earlier run."""
    return _table(VS_BEST_HEAD, _vs_best(PROTOCOL)) + "\n\n" + _source_line(PROTOCOL)


def evict_gemma() -> str:
    """Gemma-3-270m, zero-shot: the policies trained on SmolLM2 against kvpress's presses."""
    rels = ["policy/bench/gemma_tail.json"]
    return _table(VS_BEST_HEAD, _vs_best(rels)) + "\n\n" + _source_line(rels)


def evict_domains() -> str:
    """Per domain: the policy chosen on validation against the best baseline on that domain's contexts."""
    rows = _joined(PROTOCOL)
    out = []
    for keep in KEEPS:
        at = {m: r for (m, k), r in rows.items() if k == keep}
        chosen = next(m for m, r in at.items() if r.get("chosen_on_validation"))
        trained = at[chosen].get("trained_on") or []
        values = {m: r["kl_per_context"] for m, r in at.items()}
        baselines = [m for m, r in at.items() if r.get("baseline")]
        for dom, versus in _protocol().per_domain(at[chosen]["domains"], values, chosen, baselines,
                                                  clusters=passages_of(at[chosen])):
            boot = versus["boot"]
            out.append([_pct(keep), dom + (" (trained on)" if dom in trained else ""), f"{versus['mean']:.4f}",
                        versus["best"], f"{versus['best_mean']:.4f}", f"{boot['ratio']:.2f} {_ci(*boot['ratio_ci'])}",
                        f"{boot['diff']:+.4f} {_ci(*boot['diff_ci'], 4, sign=True)}", f"{versus['wins']:.2f}"])
    head = ["kept", "domain", f"{chosen} KL", "best baseline on the domain", "its KL", "ratio [95% CI]",
            "difference [95% CI]", "wins"]
    return _table(head, out) + "\n\n" + _source_line(PROTOCOL)


def evict_lodo(*rels: str) -> str:
    """Leave-one-domain-out (test slice): the policy's recipe retrained without the domain it is scored on;
    the left-out domains of each record, in order (a run can be split over records by ``corpora``)."""
    rows = [r for rel in rels for r in shipped_record(rel).rows]
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows if r["mode"].startswith("agnostic lodo-")):
        left = mode.split("lodo-", 1)[1]
        for keep in KEEPS:
            at = {r["method"]: r for r in rows if r["mode"] == mode and r["keep"] == keep and "kl_per_context" in r}
            mine = next(r for r in at.values() if r.get("chosen_on_validation"))
            shipped = next(r for m, r in at.items() if not r.get("baseline") and r is not mine)
            best_name = min((m for m, r in at.items() if r.get("baseline")), key=lambda m: at[m]["kl"])
            best = at[best_name]
            boot = paired_bootstrap(best["kl_per_context"], mine["kl_per_context"], passages_of(mine))
            out.append([left, _pct(keep), f"{mine['kl']:.4f}", f"{shipped['kl']:.4f} ({shipped['method']})",
                        f"{best['kl']:.4f} ({best_name})", f"{boot['ratio']:.2f} {_ci(*boot['ratio_ci'])}",
                        f"{boot['diff']:+.4f} {_ci(*boot['diff_ci'], 4, sign=True)}",
                        f"{mine['wins_vs_best_baseline']:.2f}", str(mine["n_contexts"])])
    head = ["left out", "kept", "policy trained without it", "shipped policy (trained on it)",
            "best baseline", "trained-without / best [95% CI]", "trained-without − best [95% CI]", "wins", "contexts"]
    return _table(head, out) + "\n\n" + _source_line(rels)


def evict_qa() -> str:
    """Context-QA accuracy of each method's pruned cache (the protocol's 66 contexts), and of the full cache."""
    rows = _joined(PROTOCOL)
    full = next(r for rel in PROTOCOL for r in shipped_record(rel).rows
                if r["method"] == "full cache" and "qa_acc" in r)
    methods = sorted(dict.fromkeys(m for m, _ in rows),
                     key=lambda m: (-max(rows[(m, k)].get("qa_acc") or 0 for k in KEEPS if (m, k) in rows), m))
    out = [["full cache", f"{full['qa_acc']:.2f}", "", ""]]
    for m in methods:
        cells = [_f(rows[(m, k)].get("qa_acc"), 2) if (m, k) in rows else "" for k in KEEPS]
        rel_full = [f"{rows[(m, k)]['qa_acc'] / full['qa_acc']:.0%}" if (m, k) in rows else "" for k in KEEPS]
        out.append([m, *cells[:1], rel_full[0], cells[1]])
    head = ["method", "QA acc. at 25 % kept", "share of the full cache's", "QA acc. at 12.5 % kept"]
    return _table(head, out) + "\n\n" + _source_line(PROTOCOL)


# decode-time runs, each one or more records over the same contexts or disjoint parts of them: each context's prefill
# selection, then 256 greedy tokens teacher-forced with the cache held at 128 tokens (cut every 8). "H2O-no-recent"
# accumulates every query (scdviz.evict.h2o: H2O's score without its recent window); "ObservedAttention" there is
# the windowed variant, kvpress's score over the last 64 rows divided by a prefill's visibility
DECODE = {"dev": ["policy/bench/decode_dev.json"],
          "test": ["policy/bench/decode_test_a.json", "policy/bench/decode_test_b.json",
                   "policy/bench/student_window_decode_test.json"]}
DECODE_AGAINST = ("ObservedAttention", "H2O-no-recent")  # the ratios shown, where the run has the method
DECODE_NAMES = {"H2O-no-recent": "H2O's score over every query, no recent window",
                "ObservedAttention": "ObservedAttention over the last 64 rows"}


def decode_run(rels: list[str]) -> dict[str, dict]:
    """One decode-time run's rows by method, over its records: each context keyed by (domain, passage, its turn
    among that passage's windows), a method two records share checked to agree per context (as ``_joined``); per
    method its KL per context in one order of the keys, passages, and top-1 / perplexity over its contexts."""
    from scdviz import metrics  # lazily: torch

    per: dict[str, dict] = {}
    for rel in rels:
        for row in shipped_record(rel).rows:
            if "decode" not in row.get("mode", "") or "kl_per_context" not in row:
                continue
            seen: dict[tuple, int] = {}
            keys = []
            for dom, pas in zip(row["domains"], row["passages"], strict=True):
                seen[(dom, pas)] = seen.get((dom, pas), 0) + 1
                keys.append((dom, pas, seen[(dom, pas)]))
            got = per.setdefault(row["method"], {"kl": {}, "top1": [], "logppl": [], "keep": row["keep"]})
            if set(keys) & set(got["kl"]):
                for k, v in zip(keys, row["kl_per_context"], strict=True):
                    if k in got["kl"] and abs(got["kl"][k] - v) > 1e-4 + 1e-3 * abs(v):
                        raise ValueError(f"{rel}: {row['method']} differs on {k} from the record before")
                continue  # the same contexts again: the first record's
            got["kl"] |= dict(zip(keys, row["kl_per_context"], strict=True))
            got["top1"].append((row["top1"], len(keys)))
            got["logppl"].append((math.log(row["ppl"]), len(keys)))
    order = sorted(set().union(*(set(m["kl"]) for m in per.values()))) if per else []
    out = {}
    for method, got in per.items():
        if set(got["kl"]) != set(order):
            continue  # a method of only part of the run
        kl = [got["kl"][k] for k in order]
        mean, se = metrics.mean_se(kl)
        n = sum(c for _, c in got["top1"])
        out[method] = {"method": method, "keep": got["keep"], "kl": mean, "kl_se": se, "kl_per_context": kl,
                       "passages": [k[1] for k in order], "n_contexts": len(order),
                       "top1": sum(v * c for v, c in got["top1"]) / n,
                       "ppl": math.exp(sum(v * c for v, c in got["logppl"]) / n)}
    return out


def evict_decode() -> str:
    """Decode-time quality, one table per run (dev, then test): every method's KL over the decoded tokens, and its
    ratio to H2O (accumulated over every query) and to the windowed ObservedAttention, with passage-bootstrap
    intervals."""
    parts = []
    for where, rels in DECODE.items():
        by = decode_run(rels)
        at = sorted(by.values(), key=lambda r: r["kl"])
        against = [m for m in DECODE_AGAINST if m in by]
        out = []
        for r in at:
            ratios = ["" if m == r["method"] else
                      "{:.3f}× {}".format(
                          (b := paired_bootstrap(by[m]["kl_per_context"], r["kl_per_context"], r["passages"]))["ratio"],
                          _ci(*b["ratio_ci"], 3)) for m in against]
            out.append([_pct(r["keep"]), r["method"], f"{r['kl']:.4f} ± {r['kl_se']:.4f}", *ratios,
                        f"{r['top1']:.3f}", f"{r['ppl']:.3f}"])
        head = ["kept", "method", "KL per decoded token ± se", *[f"KL / {DECODE_NAMES[m]} [95% CI]" for m in against],
                "top-1", "perplexity"]
        parts.append(f"{where.capitalize()} slice, {at[0]['n_contexts']} contexts:\n\n" + _table(head, out))
    return "\n\n".join(parts) + "\n\n" + _source_line([rel for rels in DECODE.values() for rel in rels])


LOOKAHEAD = "research/lookahead_matched.json"


def evict_lookahead() -> str:
    """The lookahead policy against compute-matched scorers on the same sampled continuations (dev slice):
    KL per sampling seed, and / H2O per seed with the cluster-bootstrap interval."""
    rows = shipped_record(LOOKAHEAD).rows
    seeds = sorted({r["sampling_seed"] for r in rows})
    out = []
    for horizon in sorted({r["horizon"] for r in rows}):
        for keep in KEEPS:
            at = {(r["method"], r["sampling_seed"]): r for r in rows if r["horizon"] == horizon and r["keep"] == keep}
            for m in dict.fromkeys(m for m, _ in at):
                cells = []
                for seed in seeds:
                    r, base = at[(m, seed)], at[("H2O (ObservedAttention)", seed)]
                    boot = paired_bootstrap(base["kl_per_context"], r["kl_per_context"], passages_of(r))
                    cells.append(f"{r['kl']:.4f} ({boot['ratio']:.2f}× {_ci(*boot['ratio_ci'])})")
                chosen = " *" if at[(m, seeds[0])].get("chosen_on_validation") else ""
                out.append([str(horizon), _pct(keep), m + chosen, *cells])
    n = rows[0]["n_contexts"]
    head = ["scored tokens", "kept", "top-B by"] + [f"KL (/ H2O [95% CI]), seed {s}" for s in seeds]
    return f"{n} contexts of the dev slice.\n\n" + _table(head, out) + "\n\n" + _source_line([LOOKAHEAD])


COST = "policy/bench/cost.json"


def evict_cost() -> str:
    """Every eviction method's cost in one run of ``bench cost``: added time to first token and time per
    decoded token against a plain SDPA prefill and decode of the full cache, at each context length."""
    rec = shipped_record(COST)
    out = []
    for r in rec.rows:
        if r.get("cannot_run"):
            out.append([f"{r['context_len']:,}", r["method"], "cannot run here: " + r["cannot_run"][:80],
                        "", "", "", "", ""])
            continue
        lo, hi = r["prefill_iqr_ms"]
        evicting = ("" if r.get("evicting_ms_per_token") is None else
                    f"{r['evicting_ms_per_token']:.1f} ({r['added_ms_per_token']:+.1f})")
        out.append([f"{r['context_len']:,}", r["method"], f"{r['prefill_ms']:,.0f} [{lo:,.0f}, {hi:,.0f}]",
                    f"{r['added_ttft_ms']:+,.0f}", f"{r['prefill_ratio']:.2f}×", f"{r['decode_ms_per_token']:.1f}",
                    f"{r['throughput_vs_full']:.2f}×", evicting])
    head = ["context tokens", "method", "prefill ms (median [IQR])", "added TTFT ms", "prefill / full",
            "decode ms/token (pruned cache)", "decode throughput / full", "ms/token evicting while decoding (added)"]
    s = rec.settings.get("cost", rec.settings)
    env = rec.versions or {}
    hw = env.get("hardware") or {}
    what = (f"Kept {s.get('keep', 0.25):.0%} of the context; {s.get('rounds')} timed rounds after {s.get('warmup')} "
            f"warm-up, the methods in a shuffled order each round; medians, interquartile range in brackets. The "
            f"denominator is the full cache's plain prefill (SDPA) and decode. {env.get('device', 'cpu')}, "
            f"{hw.get('cpu_count', '?')} cores, {hw.get('torch_threads', '?')} torch threads, on a machine shared with "
            "other work: read the ratios, not the milliseconds.")
    return what + "\n\n" + _table(head, out) + "\n\n" + _source_line([COST])


# ----------------------------------------------------------------------------- every run on the test slice

LEDGER = "docs/test_ledger.json"  # relative to the checkout; written by `python -m research.test_ledger`


def test_ledger() -> str:
    """Every run on the test slice in the order it was made, from the ledger ``research.test_ledger`` writes
    from the git history: its record and commit, what it measured, its result and whether it is shipped now."""
    entries = json.loads((settings.REPO_DIR / LEDGER).read_text(encoding="utf-8"))
    out = [[str(i), e["date"][:16].replace("T", " "), f"`{e['commit']}`" if e["commit"] else "not committed",
            e["family"], f"`{e['record']}`", e["measured"], e["result"],
            "no" if not e["shipped"] else "yes" if e["shipped"] == e["record"] else f"yes, as `{e['shipped']}`"]
           for i, e in enumerate(entries, 1)]
    head = ["#", "date (UTC)", "commit", "family", "record", "measured", "result", "shipped now"]
    return (_table(head, out) + f"\n\n*Records:* every test-slice version of a bench record under `assets/` in the "
            f"history of HEAD, one row per run, listed in `{LEDGER}` by `python -m research.test_ledger`.")


# ----------------------------------------------------------------------------- the README's headline


# the eviction rows of the headline: the headline method, DistillCache as docs/design.md specifies it and per head,
# and the lookahead policy (an expensive reference: sampled continuations at every prefill)
HEADLINE_EVICTION = (("Distilled scorer (headline)", "distilled-scorer"),
                     ("DistillCache as specified (one token set)", "DistillCache"),
                     ("DistillCache per KV head", "DistillCache-per-head"),
                     ("Lookahead policy (expensive reference)", "lookahead-policy"))


def _headline(scd_record: str, protocol: list[str]) -> str:
    """One table: SCD against raw KV reuse on each specialist's own eval text (``scd/<specialist>/<scd_record>``),
    and DistillCache against the best of kvpress's presses on the eviction records ``protocol``."""
    out = []
    specs, rels = _with_record(scd_record)
    for rel, spec in zip(rels, specs, strict=True):
        by = {r["method"]: r for r in _scd_rows(rel, "method")}
        raw = by["raw KV"]
        tc = next(r for r in _scd_rows(rel, "budget sweep") if r["method"] == "SCD transform-coded @3840 B/token")
        scd = "SCD (trained)" if "SCD full (closed form)" in by else "SCD"  # a record of a trained stage has twins
        for r, what in ((by["SCD full"], f"{scd}, int4 codes + 2 patches"), (tc, f"{scd}, transform coded @3,840")):
            out.append([f"{what}, {_b(r['payload_bytes_per_token'])} B/token", f"{spec}, own domain, "
                        f"{r['n_prompts']} prompts", f"raw KV reuse, {_b(raw['payload_bytes_per_token'])} B/token",
                        _ratio(raw, r), f"{r['top1']:.3f} vs {raw['top1']:.3f}",
                        f"{r['ppl']:.2f} vs {raw['ppl']:.2f} (oracle {r['ppl_oracle']:.2f})"])
    rows = _joined(protocol)
    for keep in KEEPS:
        at = {m: r for (m, k), r in rows.items() if k == keep}
        base = {m: r for m, r in at.items() if r.get("baseline")}
        best = min(base, key=lambda m: base[m]["kl"])
        for what, method in HEADLINE_EVICTION:
            boot = paired_bootstrap(base[best]["kl_per_context"], at[method]["kl_per_context"], passages_of(at[method]))
            out.append([f"{what} `{method}`, {_pct(keep)} kept",
                        f"6 domains, {at[method]['n_contexts']} contexts", f"{best} (best of kvpress's presses)",
                        f"{boot['ratio']:.2f}× {_ci(*boot['ratio_ci'])}",
                        f"{at[method]['top1']:.3f} vs {base[best]['top1']:.3f}",
                        f"{at[method]['ppl']:.2f} vs {base[best]['ppl']:.2f}"])
    head = ["method", "measured on", "against", "KL / theirs [95% CI]", "top-1 agreement, method vs theirs",
            "continuation perplexity, method vs theirs"]
    rels = rels + protocol
    return _table(head, out) + "\n\n" + _source_line(rels)


def headline() -> str:
    """The headline, on the test slice: SCD against raw KV reuse on each specialist's own domain (64
    prompts), DistillCache against the best of kvpress's presses (66 contexts, 11 per domain)."""
    return _headline("test.json", HEADLINE_PROTOCOL)


TABLES: dict[str, Callable[[], str]] = {
    "headline": headline,
    "scd-own": scd_own,
    "scd-budget": scd_budget,
    "scd-patch": scd_patch,
    "scd-lodo": scd_lodo,
    "scd-qa": scd_qa,
    "scd-ttft": scd_ttft,
    "scd-tail": scd_tail,
    "scd-distil-scale": scd_distil_scale,
    "scd-frontier": scd_frontier,
    "scd-task": scd_task,
    "scd-depth": scd_depth,
    "scd-task-layers": scd_task_layers,
    "scd-engine": lambda: serving_table.scd_engine(shipped_record),
    "evict-headline": evict_headline,
    "evict-protocol": evict_protocol,
    "evict-domains": evict_domains,
    "evict-lodo": functools.partial(evict_lodo, "policy/bench/lodo_test.json"),
    "evict-lodo-student": functools.partial(evict_lodo, "policy/bench/student_window_lodo_test_a.json.gz",
                                            "policy/bench/student_window_lodo_test_b.json.gz"),
    "evict-qa": evict_qa,
    "evict-decode": evict_decode,
    "evict-gemma": evict_gemma,
    "evict-lookahead": evict_lookahead,
    "evict-cost": evict_cost,
    "test-ledger": test_ledger,
}


# ----------------------------------------------------------------------------- marked blocks


def render(name: str) -> str:
    """Table ``name`` as markdown, ending with its records and commands."""
    if name not in TABLES:
        raise ValueError(f"unknown table {name!r}; tables: {', '.join(TABLES)}")
    return TABLES[name]()


def doc_files(root: str | Path | None = None) -> list[Path]:
    """README.md and every docs/**/*.md of the checkout at ``root`` (default: this checkout)."""
    root = Path(root) if root is not None else settings.REPO_DIR
    files = [root / "README.md"] if (root / "README.md").exists() else []
    return files + sorted((root / "docs").rglob("*.md"))


def blocks(text: str) -> list[tuple[str, str]]:
    """(name, body) of every marked block in ``text``."""
    return [(m["name"], m["body"]) for m in BLOCK.finditer(text)]


def fill(text: str, cache: dict[str, str] | None = None) -> str:
    """``text`` with every marked block's body replaced by its rendered table."""
    cache = {} if cache is None else cache

    def one(m: re.Match) -> str:
        if m["name"] not in cache:
            cache[m["name"]] = render(m["name"])
        return f"{m.group(1)}{cache[m['name']]}\n{m.group(4)}"

    return BLOCK.sub(one, text)


def stale(files: list[Path], cache: dict[str, str] | None = None) -> list[str]:
    """``FILE: table NAME`` for each marked block whose body differs from what the records give."""
    cache = {} if cache is None else cache
    out = []
    for path in files:
        text = path.read_text()
        for name, body in blocks(text):
            if name not in cache:
                cache[name] = render(name)
            if body != cache[name] + "\n":
                out.append(f"{path}: table {name}")
    return out


def update(files: list[Path]) -> list[Path]:
    """Rewrite the marked blocks of ``files``; the files that changed."""
    cache: dict[str, str] = {}
    changed = []
    for path in files:
        text = path.read_text()
        new = fill(text, cache)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed

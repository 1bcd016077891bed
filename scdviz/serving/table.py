"""The engine table, rendered from its record: ``assets/scd/engine.json`` (``python -m research.engine_demo --record``).

One row per specialist, prompt length and run (its own prefill, raw KV, each SCD plan the connector moves), from
one harness run: time to first token in the specialist's vLLM engine at each modelled link, the payload's bytes,
the producer's encode time, and KL / top-1 in the engine beside scdviz's own numbers outside it on the same
prompts. Library layer: reads the record only (no torch, no engine); ``research.engine_demo`` prints the same table
from the record it has just written.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from scdviz import records, settings

RECORD = "scd/engine.json"  # under assets/
COMMAND = "python -m research.engine_demo"


def _ms(x) -> str:
    return "" if x is None else f"{round(x):,}"


def _f(x, nd: int) -> str:
    return "" if x is None else f"{x:.{nd}f}"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def gbps_of(rows: list[dict]) -> list[float]:
    """The link speeds a record's rows carry (``ttft_<g>gbps_ms``), slowest first."""
    keys = {k for r in rows for k in r if k.startswith("ttft_") and k.endswith("gbps_ms") and "with" not in k}
    return sorted(float(k[len("ttft_"):-len("gbps_ms")]) for k in keys)


def _label(g: float) -> str:
    return f"{g:g}"


def _versus(row: dict, key: str, own_ms: float) -> str:
    """A transfer's TTFT at one link against the own prefill's, and again with the producer's encode added."""
    text = f"{row['method']} {_ms(row[key])} ms ({'below' if row[key] < own_ms else 'NOT below'}"
    with_encode = row.get(key.replace("ttft_", "ttft_with_encode_"))
    if with_encode is not None:
        text += (f"; {_ms(with_encode)} ms with the producer's encode added, "
                 f"{'below' if with_encode < own_ms else 'NOT below'}")
    return text + ")"


def summary(rows: list[dict], prefix: int = 1024, gbps: float = 1.0) -> list[str]:
    """One sentence per specialist: each transfer's TTFT at ``prefix`` tokens and ``gbps`` against its own
    prefill's (the issue's bar: SCD's below the own prefill's at 1k tokens and 1 Gbit/s)."""
    key = f"ttft_{_label(gbps)}gbps_ms"
    out = []
    for spec in dict.fromkeys(r["specialist"] for r in rows):
        mine = [r for r in rows if r["specialist"] == spec and r["prefix_tokens"] == prefix]
        own = next((r for r in mine if r["channel"] == "own"), None)
        sent = [r for r in mine if r["channel"] != "own" and r.get(key) is not None]
        if own is None or not sent:
            continue
        out.append(f"{spec}, {_tokens(prefix)} tokens at {_label(gbps)} Gbit/s: own prefill {_ms(own['engine_ms'])} "
                   "ms; " + "; ".join(_versus(r, key, own["engine_ms"]) for r in sent) + ".")
    return out


def _cells(r: dict, gbps: list[float]) -> list[str]:
    """One row of the table."""
    own = r["channel"] == "own"
    iqr = r.get("engine_iqr_ms") or [None, None]
    engine = f"{_ms(r['engine_ms'])} [{_ms(iqr[0])}, {_ms(iqr[1])}]"
    if own:
        return [r["specialist"], f"{r['prefix_tokens']:,} + 1", r["method"], "", engine, "",
                "= engine ms (nothing sent)", "", "", ""]
    return [r["specialist"], f"{r['prefix_tokens']:,} + 1", r["method"], f"{r['bytes_per_token']:,.0f}", engine,
            _ms(r.get("load_ms")), " / ".join(_ms(r.get(f"ttft_{_label(g)}gbps_ms")) for g in gbps),
            _ms(r.get("encode_ms")), f"{_f(r['kl_engine'], 5)} / {_f(r['kl_outside'], 5)}",
            f"{_f(r['top1_engine'], 4)} / {_f(r['top1_outside'], 4)}"]


def render(record: records.BenchRecord, path: str = f"assets/{RECORD}") -> str:
    """The table of an engine record, its notes and the line naming the record and its command."""
    rows, s = record.rows, record.settings
    gbps = gbps_of(rows)
    head = ["specialist", "prompt tokens (prefix + 1)", "run", "B/token", "engine ms, median [IQR]",
            "of which load ms", "TTFT ms at " + " / ".join(_label(g) for g in gbps) + " Gbit/s", "encode ms",
            "KL in engine / outside", "top-1 in engine / outside"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cells(r, gbps)) + " |" for r in rows]
    producer = {}
    for r in rows:
        producer.setdefault(r["prefix_tokens"], r.get("producer_request_ms"))
    versions = record.versions or {}
    load = versions.get("load_average") or {}
    notes = [
        f"TTFT = engine ms + latency ({s.get('latency_ms', 0):g} ms) + payload bytes × 8 / bandwidth, per prompt and "
        "round, then the median; own prefill: engine ms, nothing sent. *Engine ms*: request to first token in the "
        "specialist's vLLM engine (its merged weights) with the payload already in the shared folder: reading it, "
        "decoding it into the specialist's own K / V (token 0 recomputed), writing them into the paged blocks "
        "(*of which load ms*: the connector's read, decode and write, median), computing the last prompt token and "
        f"sampling; {s.get('repeats')} rounds after a warm-up on {s.get('timing_prompts')} prompts per length. "
        "Not counted: the producer's prefill (in disaggregated serving it runs anyway) and its encode (*encode ms*, "
        "the producer engine's connector, median per prompt; to be added for a prefill made for this request "
        "alone).",
        "Fan-out: one producer engine prefilled each prompt once and wrote one payload per channel into the shared "
        "folder (raw KV, shared by both specialists; each SCD plan with each specialist's own calibration, "
        "`assets/scd/<name>/`); each specialist's engine ran after it, one at a time, and loaded its own. The "
        "producer's request (one prefill, every payload encoded and written), median ms: "
        + ", ".join(f"{_tokens(k)} {_ms(v)}" for k, v in sorted(producer.items())) + ".",
        f"Quality: {s.get('prompts')} held-out windows per length ({s.get('slice')} slice; "
        f"{', '.join(s.get('domains') or [])}, alternating), KL(own prefill ‖ run) per token averaged per prompt "
        f"then over prompts, and top-1 agreement, over {s.get('cont')} teacher-forced continuation tokens: in the "
        "engine against the specialist's own prefill in the same engine, outside it as `bench scd` measures "
        "(`scdviz.scd.transfer`). SCD here is REUSE-only (every layer's K / V sent as codes of the producer's and "
        "decoded into the specialist's own); SCD full's PATCH layers are not available in the engine: they need "
        "the producer's pre-attention hidden states, which the paged KV cache does not hold.",
        *summary(rows),
        f"One {versions.get('hardware', {}).get('cpu_count', '?')}-core CPU, no GPU; vLLM "
        f"{(versions.get('engine') or {}).get('vllm', '?')} (float32, eager, prefix caching off). Load average "
        "(1 / 5 / 15 min) at start " + " / ".join(f"{x:.2f}" for x in load.get("start", [])) + ", at the end "
        + " / ".join(f"{x:.2f}" for x in load.get("end", [])) + ".",
    ]
    command = s.get("command") or f"{COMMAND} --record"
    # the docs' source line, as every table of scdviz.report ends (tests/test_docs.py reads it)
    source = f"*Records (and the command that made each):* `{path}` ({s.get('slice')} slice): `{command}`."
    return "\n".join(lines) + "\n\n" + "\n\n".join(notes) + "\n\n" + source


def scd_engine(read: Callable[[str], records.BenchRecord] | None = None, rel: str = RECORD) -> str:
    """The engine table from the shipped record ``assets/<rel>``. ``read`` opens a shipped record by its path under
    assets/ (``report.shipped_record`` there, so its checks see which records the tables read); default: read the
    file. For ``report.TABLES``: ``"scd-engine": lambda: table.scd_engine(shipped_record)``."""
    record = read(rel) if read is not None else records.read(Path(settings.ASSETS_DIR) / rel)
    return render(record, f"assets/{rel}")

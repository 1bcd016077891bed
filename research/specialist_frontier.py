"""Specialist recipes on the frontier of (raw reuse's damage) × (the specialist's gain over the producer) (issue 62).

Each candidate consumer (``--consumers LABEL=SOURCE ...``: adapter folders ``finetune`` wrote, or built-in
specialists) is measured on the same eval windows of its task's text (``--domain``, default each one's training
corpus), each prompt followed by the context-QA question of the SCD bench (scdviz.qa, ``--qa-answer-len`` answer
tokens; a recall specialist's questions are the ones it was trained to answer). Per prompt:

- the task score (token F1 of the greedy answer against the reference) of the **producer** alone (its own cache),
  of the **specialist** (the oracle: its own cache) and of **raw reuse** (the specialist answering from the
  producer's cache, sent as is);
- raw reuse's KL(oracle ‖ raw reuse) and top-1 agreement over the teacher-forced continuation, and the
  continuation's perplexity for the producer, the specialist and raw reuse (is the specialist still a language
  model of the text?).

Printed per candidate: the specialist's gain over the producer (its F1 ÷ the producer's) and raw reuse's share of the
oracle's F1, each with a paired passage-bootstrap interval, raw reuse's top-1 and KL, the adapter's size and its
recipe. ``--out`` writes the record (every per-prompt value), from which docs/results.md's frontier table is made.
Recipes are chosen on ``--slice dev``; ``test`` runs only from a clean committed tree.

    python -m research.specialist_frontier --domain austen --limit 64 \\
        --consumers kv16=runs/r62/kv16 all8=runs/r62/all8 --out runs/r62/frontier_dev.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from scdviz import data, metrics, protocol, qa, records
from scdviz.models import hf
from scdviz.models import pair as pairmod
from scdviz.models.pair import choose_threads, load_pair, resolve_source
from scdviz.scd import measure, transfer
from scdviz.scd import plan as plans


def recipe(source: str) -> dict:
    """The consumer's training settings, time and tokens (its train_log.json) and its adapter's size; {} for a
    full model."""
    adapter = resolve_source(source)[2]
    if adapter is None:
        return {}
    log = pairmod.training_log(source)
    size = sum(f.stat().st_size for f in Path(adapter).glob("*.safetensors"))
    return {"config": log.get("config", {}), "seconds": log.get("seconds"), "tokens_seen": log.get("tokens_seen"),
            "adapter_bytes": size}


def producer_alone(pair, case) -> tuple[float, list[float]]:
    """The producer's own answer to the case's question (its token F1) and its own teacher-forced continuation
    (negative log-likelihood per token), each from its own cache of the prompt."""
    start = case.state.ids.shape[1]
    cache = hf.decoder_cache(pair.producer, case.state.ids.to(hf.device_of(pair.producer)))
    logits, _ = transfer.continuation(pair.producer, cache, case.fed, start)
    nll = metrics.nll_per_token(logits, case.targets[0].to(logits.device)).tolist()
    return qa.answer(pair.producer, cache, case.qa_item, start)["qa_f1"], nll


def measure_one(label: str, producer: str, source: str, domain: str | None, args) -> dict:
    """Every per-prompt value of one candidate on its task's eval windows."""
    pair = load_pair(producer, source)
    info = recipe(source)
    domain = domain or info.get("config", {}).get("corpus")
    if not domain:
        raise SystemExit(f"{source}: no training corpus known; give --domain")
    windows = data.eval_windows(pair.tokenizer, domain, args.slice, args.prompt_len + args.cont_len, args.limit)
    torch.manual_seed(0)
    kind = qa.kind_for(source)  # the question bench scd asks this consumer
    cases = measure.prepare_cases(pair, [w.ids for w in windows], args.cont_len, True, args.qa_answer_len, kind)
    oracle, _ = measure.oracle_result(pair, cases, 0)
    raw = measure.run_plan_on_cases(pair, cases, plans.raw_plan(pair.consumer_facts.layers), None)
    alone = [producer_alone(pair, c) for c in cases]
    return {"label": label, "consumer": source, "domain": domain, "question": kind,
            "passages": [w.cluster for w in windows], "ppl_oracle": oracle.ppl, "ppl_raw": raw.ppl,
            "ppl_producer": metrics.perplexity([x for a in alone for x in a[1]]),
            "qa_f1_producer": [a[0] for a in alone], "qa_f1_oracle": oracle.qa_f1,
            "qa_f1_raw": raw.qa_f1, "kl_raw": raw.kl_per_prompt, "kl_raw_mean": raw.kl, "top1_raw": raw.top1,
            "recipe": info}


def summary(row: dict) -> dict:
    """The printed line of one candidate: gain and raw reuse's share, with paired passage-bootstrap intervals."""
    clusters = row["passages"]

    def ratio(base: str, mine: str) -> str:
        got = metrics.paired_bootstrap(row[base], row[mine], clusters=clusters)
        return f"{got['ratio']:.2f} [{got['ratio_ci'][0]:.2f}, {got['ratio_ci'][1]:.2f}]"

    def mean(key: str) -> float:
        return round(sum(row[key]) / len(row[key]), 3)

    cfg = row["recipe"].get("config", {})
    return {"candidate": row["label"], "task": cfg.get("task", "text"), "asked": row["question"],
            "targets": " ".join(cfg.get("targets", [])), "rank": cfg.get("rank"), "lr": cfg.get("lr"),
            "steps": cfg.get("steps"), "MB": round(row["recipe"].get("adapter_bytes", 0) / 1e6, 1),
            "F1 producer": mean("qa_f1_producer"), "F1 specialist": mean("qa_f1_oracle"),
            "F1 raw reuse": mean("qa_f1_raw"), "gain (specialist ÷ producer)": ratio("qa_f1_producer", "qa_f1_oracle"),
            "raw ÷ specialist": ratio("qa_f1_oracle", "qa_f1_raw"), "raw top-1": round(row["top1_raw"], 3),
            "PPL producer / specialist / raw": " / ".join(f"{row[k]:.1f}" for k in ("ppl_producer", "ppl_oracle",
                                                                                   "ppl_raw")),
            "raw KL": round(row["kl_raw_mean"], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--producer", default="builtin:smollm2-135m")
    ap.add_argument("--consumers", nargs="+", required=True, help="LABEL=SOURCE, one per candidate")
    ap.add_argument("--domain", default=None, help="the text measured (default: each candidate's training corpus)")
    ap.add_argument("--slice", default="dev", choices=data.SLICES)
    ap.add_argument("--limit", type=int, default=64, help="eval windows")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--cont-len", type=int, default=32)
    ap.add_argument("--qa-answer-len", type=int, default=8)
    ap.add_argument("--out", default="", help="write the record here (every per-prompt value)")
    args = ap.parse_args()
    protocol.check_slice(args.slice)
    print(f"torch threads: {choose_threads()}")
    settings = {"research": "specialist_frontier", "producer": args.producer, "consumers": args.consumers,
                "domain": args.domain, "slice": args.slice, "limit": args.limit, "prompt_len": args.prompt_len,
                "cont_len": args.cont_len, "qa_answer_len": args.qa_answer_len}
    done = measured(Path(args.out), settings) if args.out else {}
    t0, rows = time.perf_counter(), []
    for spec in args.consumers:
        label, _, source = spec.partition("=")
        if not source:
            raise SystemExit(f"--consumers takes LABEL=SOURCE, got {spec!r}")
        rows.append(done.get(spec) or measure_one(label, args.producer, source, args.domain, args))
        print(protocol.show(pd.DataFrame([summary(r) for r in rows])), flush=True)
        if args.out:  # after each candidate: a stopped run started again measures only the ones left
            records.write(records.make("scd", settings, 0, rows, "cpu", time.perf_counter() - t0), Path(args.out))
    if args.out:
        print(f"record: {args.out}")


def measured(path: Path, settings: dict) -> dict[str, dict]:
    """The rows a record at ``path`` already holds, by LABEL=SOURCE, when it was made with these settings (its
    candidates aside); {} when there is none. Another record there is refused, not overwritten."""
    if not path.exists():
        return {}
    old = records.read(path)
    if {k: v for k, v in old.settings.items() if k != "consumers"} != {k: v for k, v in settings.items()
                                                                        if k != "consumers"}:
        raise SystemExit(f"{path} holds a record made with other settings; give another --out")
    return {f"{r['label']}={r['consumer']}": r for r in old.rows}


if __name__ == "__main__":
    main()

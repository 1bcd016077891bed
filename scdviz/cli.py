"""Command line: ``python -m scdviz <command> ...``; every flag comes from a config dataclass.

Each command is a dataclass of its settings (model sources, output, and the method's own
config, nested) plus a function that runs it. ``scdviz.config.add_arguments`` makes the
flags, so defaults and help live in one place and ``--help`` shows both; lists are
space-separated (``--budgets 2500 3800 5000``). Errors a user can fix are printed as one
line (no traceback) with exit status 2. Bench commands write a scdviz.records.BenchRecord.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from scdviz import config, records
from scdviz.config import opt
from scdviz.evict.compare import EvalConfig
from scdviz.evict.trainer import TrainConfig
from scdviz.finetune import FinetuneConfig
from scdviz.scd.bench import ScdBenchConfig
from scdviz.scd.calibrate import CalibConfig
from scdviz.scd.ttft import TtftConfig

PRODUCER = "builtin:smollm2-135m"  # the built-in producer
SOURCE_HELP = "model source: builtin:NAME, a local folder, or a hub id"


@dataclass
class PairInfo:
    producer: str = opt(PRODUCER, f"producer {SOURCE_HELP}")
    consumer: str = opt("builtin:jargon", f"consumer {SOURCE_HELP}")
    eval: bool = opt(False, "also held-out perplexity and raw-reuse drift")
    limit: int = opt(16, "held-out prompts per corpus")
    prompt_len: int = opt(256, "prompt tokens")
    cont_len: int = opt(32, "teacher-forced continuation tokens")
    out: str | None = opt(None, "write the report as JSON")


@dataclass
class ModelCard:
    name: str = opt(help="specialist folder under assets/adapters/", required=True)
    limit: int = opt(16, "held-out prompts per corpus")


@dataclass
class _OnePair:
    producer: str = opt(PRODUCER, f"producer {SOURCE_HELP}")
    consumer: str = opt("builtin:jargon", f"consumer {SOURCE_HELP}")


@dataclass
class Calibrate(_OnePair):
    out: str | None = opt(None, "output folder (default: assets/scd/<specialist> for built-ins)")
    store_rank: int | None = opt(None, "store codes up to this rank only (smaller file)")
    calib: CalibConfig = field(default_factory=CalibConfig)


@dataclass
class Rate(_OnePair):
    calib: str | None = opt(None, "calibration folder to measure and update (default: the shipped one of a built-in)")
    windows: int = opt(6, "calibration windows to measure on")


@dataclass
class BenchScd:
    producer: str = opt(PRODUCER, f"producer {SOURCE_HELP}")
    consumers: list[str] = opt([], "consumer sources (default: every built-in specialist)")
    calibs: list[str] = opt([], "calibration folders, one per consumer (default: the shipped ones)")
    out: str | None = opt(None, "write the benchmark record (JSON) here")
    bench: ScdBenchConfig = field(default_factory=ScdBenchConfig)


@dataclass
class BenchTtft(_OnePair):
    calib: str | None = opt(None, "calibration folder (default: the shipped one of a built-in)")
    out: str | None = opt(None, "write the benchmark record (JSON) here")
    ttft: TtftConfig = field(default_factory=TtftConfig)


@dataclass
class TrainPolicy:
    model: str = opt(PRODUCER, f"{SOURCE_HELP}: the model whose caches are pruned")
    resume: bool = opt(False, "continue the run in --out")
    train: TrainConfig = field(default_factory=lambda: TrainConfig(out=""))


@dataclass
class BenchEvict:
    models: list[str] = opt([PRODUCER], "model sources; the first is the policies' own, the others test zero-shot transfer")
    out: str | None = opt(None, "write the benchmark record (JSON) here")
    eval: EvalConfig = field(default_factory=EvalConfig)


# ----------------------------------------------------------------------------- commands


def _app(_) -> None:
    from scdviz.webapp import main

    main()


def _download(_) -> None:
    from scdviz.models import builtin

    print(builtin.producer_dir())


def _prepare_text(_) -> None:
    from scdviz import prepare_text

    prepare_text.main()


def _finetune(cfg: FinetuneConfig) -> None:
    from scdviz.finetune import finetune
    from scdviz.models.pair import choose_threads

    print(f"torch threads: {choose_threads()}")
    log = finetune(cfg)
    print(f"done in {log['seconds']} s; loss {log['loss'][0]} -> {sum(log['loss'][-5:]) / 5:.3f} (mean of last 5)")


def _pair_info(cmd: PairInfo) -> None:
    import json

    from scdviz import drift
    from scdviz.models.pair import load_pair

    pair = load_pair(cmd.producer, cmd.consumer)
    print(drift.facts_table(pair))
    print(f"loaded in {pair.load_seconds:.1f} s on {pair.device} ({pair.dtype})")
    if cmd.eval:
        report = drift.evaluate_pair(pair, n_prompts=cmd.limit, prompt_len=cmd.prompt_len, cont_len=cmd.cont_len)
        print(drift.report_table(report))
        if cmd.out:
            Path(cmd.out).write_text(json.dumps(records.finite(report), indent=1))


def _model_card(cmd: ModelCard) -> None:
    from scdviz.modelcard import write_card

    print(write_card(cmd.name, n_prompts=cmd.limit))


def _calibrate(cmd: Calibrate) -> None:
    from scdviz.models.pair import load_pair
    from scdviz.scd import calibrate as cal

    pair = load_pair(cmd.producer, cmd.consumer)
    calib = cal.calibrate(pair, cmd.calib)
    out = Path(cmd.out) if cmd.out else cal.shipped_folder(cmd.consumer)
    cal.save(calib, out, cmd.store_rank)
    print(f"patch order ({calib.config.selection}): {calib.patch_order}; drift order: {calib.drift_order}")
    if calib.selection_kl:
        print("selection KL after each added patch: " + ", ".join(f"{x:.4f}" for x in calib.selection_kl))
    print(f"saved to {out} in {calib.stats['seconds_total']} s")


def _rate(cmd: Rate) -> None:
    from scdviz.models.pair import load_pair
    from scdviz.scd import calibrate as cal
    from scdviz.scd import rate

    if cmd.windows < 1:
        raise ValueError(f"--windows must be at least 1, got {cmd.windows}")
    pair = load_pair(cmd.producer, cmd.consumer)
    folder = Path(cmd.calib) if cmd.calib else cal.shipped_folder(cmd.consumer)
    calib = cal.load(folder, pair)
    calib.rate = rate.measure(pair, calib, cmd.windows)
    calib.stats["seconds_rate"] = round(calib.rate.seconds, 1)
    cal.save(calib, folder)
    print(f"rate curves of {len(calib.rate.bits)} code precisions x ranks 0..{calib.rate.err_k.shape[2] - 1}, "
          f"{len(calib.rate.patch_layers)} patch layers, measured on {calib.rate.n_windows} windows in "
          f"{calib.rate.seconds:.0f} s; saved into {folder}")


def _bench_scd(cmd: BenchScd) -> None:
    from scdviz.models import builtin
    from scdviz.models.pair import load_pair
    from scdviz.scd import bench
    from scdviz.scd import calibrate as cal

    consumers = cmd.consumers or [f"builtin:{s}" for s in builtin.specialists()]
    if not consumers:
        raise ValueError("no consumer given and no built-in specialist installed")
    folders = cmd.calibs or [str(cal.shipped_folder(c)) for c in consumers]
    if len(folders) != len(consumers):
        raise ValueError("give one --calibs folder per --consumers source")
    rows, device, reports = [], "", []
    for consumer, folder in zip(consumers, folders):
        pair = load_pair(cmd.producer, consumer)
        device = str(pair.device)
        for report in bench.run(cmd.bench, pair, cal.load(folder, pair)):
            n = report.methods[0].n_prompts
            seen = "held out of" if report.domain not in report.calibrated_on else "in"
            print(f"\n== {report.specialist} on {report.domain} ({seen} the calibration's domains; {n} prompts of "
                  f"{cmd.bench.prompt_len} tokens + {cmd.bench.cont_len}) ==")
            print(report.table().to_string(index=False))
            proj = [p for p in report.projection if p["model"] == "Mistral-7B" and p["gpu"] == bench.PROJECTION_GPU.name and p["link_gbps"] == 10]
            print(f"analytic projection (not measured): {bench.PROJECTION_GPU.name}, {bench.PROJECTION_TOKENS} tokens, 10 Gbit/s, "
                  "Mistral-7B: " + ", ".join(f"{p['method']} {p['speedup']:.2f}x" for p in proj))
            rows += bench.rows(report)
            reports.append(report)
    print("\n== per domain: raw reuse vs SCD full, same token-0 handling (ratio_ci: paired bootstrap over prompts) ==")
    print(bench.domain_table(reports).to_string(index=False))
    if cmd.bench.sweeps:
        print("\n== patch-budget sweep: KL at k patch layers, relative to k = 0 (vs_k0_ci95: paired bootstrap over prompts) ==")
        print(bench.patch_table(reports).to_string(index=False))
    if cmd.bench.rank_claim:
        print("\n== rank claim: one rank for every key code (values at full rank) and vice versa, KL relative to "
              "reuse-only at full rank (ci95: paired bootstrap over prompts) ==")
        print(bench.rank_claim_table(reports).to_string(index=False))
    if cmd.bench.budgets:
        print("\n== budget sweep: rate-distortion plans (a hard byte limit) and rank-only allocation, KL relative to raw "
              "reuse (vs_raw_ci95: paired bootstrap over prompts) ==")
        print(bench.budget_table(reports).to_string(index=False))
    qa_rows = bench.qa_table(reports)
    if len(qa_rows):
        print(f"\n== context-QA token-F1, {qa_rows['items'].iloc[0]} items pooled over the reports (95% bootstrap) ==")
        print(qa_rows.to_string(index=False))
    _write(cmd, "scd", cmd.bench.seed, rows, device)


def _train_policy(cmd: TrainPolicy) -> None:
    from scdviz.evict.trainer import run_folder, train
    from scdviz.models.pair import choose_threads, load_model

    run_folder(cmd.train, cmd.resume)  # refuse a bad --out before loading a model
    print(f"torch threads: {choose_threads()}")
    model, tokenizer = load_model(cmd.model)
    log = train(cmd.train, model, tokenizer, cmd.model, resume=cmd.resume)
    best = min(log["val"], key=lambda v: v["kl"]) if log["val"] else None
    print(f"done in {log['seconds']} s; heuristic val KL {log['val_heuristic']}; best val KL {best}")


def _bench_evict(cmd: BenchEvict) -> None:
    from scdviz.evict import compare
    from scdviz.models import hf
    from scdviz.models.pair import choose_threads, load_model

    if not cmd.models:
        raise ValueError("give at least one model source (--models)")
    print(f"torch threads: {choose_threads()}")
    models = {source: load_model(source) for source in dict.fromkeys(cmd.models)}
    rows = compare.run(cmd.eval, models)
    print(compare.table(rows))
    if per_domain := compare.domain_table(rows):
        print("\nper domain: the policy chosen on validation vs the best baseline on that domain's contexts")
        print(compare.domain_text(per_domain))
    _write(cmd, "evict", cmd.eval.seed, rows, str(hf.device_of(next(iter(models.values()))[0])))


def _bench_ttft(cmd: BenchTtft) -> None:
    import pandas as pd

    from scdviz.models.pair import load_pair
    from scdviz.scd import calibrate as cal
    from scdviz.scd import ttft

    pair = load_pair(cmd.producer, cmd.consumer)
    calib = cal.load(cmd.calib or cal.shipped_folder(cmd.consumer), pair)
    table = ttft.run(cmd.ttft, pair, calib)
    c = cmd.ttft
    print(f"\n== time to first token, {c.prompt_len}-token prompts, {c.limit} prompts x {c.reps} interleaved rounds after "
          f"{c.warmup} warm-up, medians; device {pair.device}, {cal.specialist_name(cmd.consumer)} ==")
    print(f"oracle (consumer prefill + first step): {table['oracle_ms'].iloc[0]} ms; producer prefill: "
          f"{table['producer_prefill_ms'].iloc[0]} ms")
    with pd.option_context("display.width", 250, "display.max_columns", 40):
        steps = ["method", "bytes_per_token", "encode_ms", "receive_ms", "first_step_ms", "compute_iqr_ms"]
        print(table[steps].iloc[1:].to_string(index=False))
        for label, what in (("", "without the producer's prefill"), ("_with_prefill", "with the producer's prefill"),
                            (f"_shared{c.fan_out}", f"with the producer's prefill shared by {c.fan_out} specialists")):
            cols = [f"ttft{label}_{g:g}gbps_ms" for g in ttft.BANDWIDTHS] + [f"break_even{label}_gbps"]
            print(f"\nTTFT (ms) {what}; break-even: the slowest link (Gbit/s) at which the method still beats the oracle")
            print(table[["method", *cols]].iloc[1:].to_string(index=False))
    _write(cmd, "ttft", c.seed, table.to_dict("records"), str(pair.device))


def _write(cmd, kind: str, seed: int, rows: list[dict], device: str) -> None:
    if cmd.out:
        path = records.write(records.make(kind, config.to_dict(cmd), seed, rows, device), cmd.out)
        print(f"wrote {len(rows)} rows to {path}")


# name, help, settings dataclass (None: no flags), function
COMMANDS = [
    ("app", "start the web app (settings from SCDVIZ_* / GRADIO_SERVER_* variables)", None, _app),
    ("download", "fetch and convert the built-in producer (first use)", None, _download),
    ("pair-info", "print a pair's facts; --eval adds perplexity and drift", PairInfo, _pair_info),
    ("finetune", "train a LoRA specialist on a shipped corpus", FinetuneConfig, _finetune),
    ("model-card", "measure a built-in specialist and write its model card", ModelCard, _model_card),
    ("prepare-text", "rebuild assets/text from Debian's text packages", None, _prepare_text),
    ("calibrate", "fit an SCD calibration (codes, aligners, patch layers) for a pair", Calibrate, _calibrate),
    ("train-policy", "train the DistillCache eviction policy (REINFORCE)", TrainPolicy, _train_policy),
    ("rate", "measure an SCD calibration's rate-distortion curves for the budget planner (saved into it)", Rate, _rate),
    ("bench scd", "every SCD method and baseline on held-out text", BenchScd, _bench_scd),
    ("bench ttft", "time to first token of every SCD method and baseline vs the consumer's own prefill (interleaved medians)",
     BenchTtft, _bench_ttft),
    ("bench evict", "learned eviction vs kvpress baselines (KL, top-1, PPL, wins)", BenchEvict, _bench_evict),
]


def parser() -> argparse.ArgumentParser:
    """The argparse tree of COMMANDS (``bench scd`` is the ``scd`` subcommand of ``bench``)."""
    top = argparse.ArgumentParser(prog="python -m scdviz", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, help_text, settings, fn in COMMANDS:
        where = sub
        if " " in name:
            group, name = name.split(" ", 1)
            if group not in groups:
                groups[group] = sub.add_parser(group, help="benchmarks that print tables and write records").add_subparsers(
                    dest=group, required=True)
            where = groups[group]
        p = where.add_parser(name, help=help_text, description=help_text)
        if settings is not None:
            config.add_arguments(p, settings)
        p.set_defaults(fn=fn, settings=settings)
    return top


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as done:  # --help, or a flag argparse refused (it printed why)
        return int(done.code or 0)
    from scdviz.models.pair import PairError

    try:
        cmd = config.from_args(args.settings, args) if args.settings is not None else None
        args.fn(cmd)
    except (PairError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0

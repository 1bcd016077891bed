"""Command line: ``python -m scdviz <command> ...``; every flag comes from a config dataclass.

Each command is a dataclass of its settings (scdviz.commands: model sources, output, and the
method's own config, nested) plus a function here that runs it. ``scdviz.config.add_arguments`` makes the
flags, so defaults and help live in one place and ``--help`` shows both; lists are
space-separated (``--budgets 2500 3800 5000``). Errors a user can fix are printed as one
line (no traceback) with exit status 2. Bench commands write a scdviz.records.BenchRecord.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from scdviz import config, protocol, records, runs, settings
from scdviz.commands import (
    SOURCE_HELP,
    BenchCost,
    BenchEvict,
    BenchScd,
    BenchTtft,
    Calibrate,
    Distil,
    Finetune,
    FitStudent,
    ModelCard,
    PairInfo,
    PrepareText,
    Rate,
    Report,
    TrainPolicy,
)

# ----------------------------------------------------------------------------- commands


def _app(_) -> None:
    from scdviz.app.webapp import main

    main()


def _download(_) -> None:
    from scdviz.models import builtin

    print(builtin.producer_dir())


def _prepare_text(cmd: PrepareText) -> None:
    from scdviz import prepare_text

    _need_maintainer(cmd, "rebuilds assets/text")
    prepare_text.main()


def _need_maintainer(cmd, what: str) -> None:
    if not cmd.maintainer:
        raise ValueError(f"this command {what}, in the repository's shipped assets/: add --maintainer to do so")


def _finetune(cmd: Finetune) -> None:
    from scdviz.finetune import finetune
    from scdviz.models.pair import choose_threads

    cfg = cmd.finetune
    name = cmd.name or (Path(cfg.texts).stem if cfg.texts else cfg.corpus)
    if not name:
        raise ValueError("give either --texts (your text) or --corpus (a shipped one)")
    out = _out_folder(cfg.out, "specialists", name, cmd.maintainer, settings.ASSETS_DIR / "adapters" / name)
    cfg = dataclasses.replace(cfg, out=str(out))
    print(f"torch threads: {choose_threads()}")
    t0 = time.perf_counter()
    log = finetune(cfg)
    _save_run(cmd, out, "finetune", cfg.seed, "", time.perf_counter() - t0)
    tail = log['loss'][-5:]
    print(f"done in {log['seconds']} s; loss {log['loss'][0]} -> {sum(tail) / len(tail):.3f} "
          f"(mean of the last {len(tail)})")
    print(f"specialist saved to {out}; use it as --consumer {out}")


def _pair_info(cmd: PairInfo) -> None:
    import json

    from scdviz import drift
    from scdviz.models.pair import load_pair

    pair = load_pair(cmd.producer, cmd.consumer)
    print(drift.facts_table(pair))
    print(f"loaded in {pair.load_seconds:.1f} s on {pair.device} ({pair.dtype})")
    if cmd.eval:
        report = drift.evaluate_pair(pair, n_prompts=cmd.limit, prompt_len=cmd.prompt_len, cont_len=cmd.cont_len,
                                     texts=cmd.texts)
        print(drift.report_table(report))
        if cmd.out:
            path = _check_writable(Path(cmd.out), False)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(records.finite(report), indent=1))


def _model_card(cmd: ModelCard) -> None:
    from scdviz.modelcard import write_card

    _need_maintainer(cmd, f"writes assets/adapters/{cmd.name}/README.md")
    print(write_card(cmd.name, n_prompts=cmd.limit))


def _calibrate(cmd: Calibrate) -> None:
    from scdviz.models.pair import load_pair
    from scdviz.scd import calibrate as cal
    from scdviz.scd import calibration

    name = cmd.name or calibration.specialist_name(cmd.consumer)
    out = _out_folder(cmd.out, "calibrations", name, cmd.maintainer, calibration.shipped_folder(cmd.consumer))
    pair = load_pair(cmd.producer, cmd.consumer)
    t0 = time.perf_counter()
    calib = cal.calibrate(cmd.calib, pair)
    calib.save(out, cmd.store_rank)
    _save_run(cmd, out, "calibrate", None, str(pair.device), time.perf_counter() - t0)
    print(f"patch order ({'given' if calib.config.given else 'greedy'}): {calib.patch_order}; "
          f"drift order: {calib.drift_order}")
    if calib.selection_kl:
        print("selection KL after each added patch: " + ", ".join(f"{x:.4f}" for x in calib.selection_kl))
    print(f"saved to {out} in {calib.stats['seconds_total']} s")


def _calib_folder(consumer: str) -> Path:
    """A consumer's calibration by default: the user's own in the runs folder, else the shipped one."""
    from scdviz.scd import calibration

    mine = runs.root() / "calibrations" / calibration.specialist_name(consumer)
    folder = mine if (mine / "calibration.safetensors").is_file() else calibration.shipped_folder(consumer)
    print(f"calibration of {consumer}: {folder}")
    return folder


def _rate(cmd: Rate) -> None:
    from scdviz.models.pair import load_pair
    from scdviz.scd import calibration, rate

    if cmd.windows < 1:
        raise ValueError(f"--windows must be at least 1, got {cmd.windows}")
    folder = Path(cmd.calib) if cmd.calib else _calib_folder(cmd.consumer)
    pair = load_pair(cmd.producer, cmd.consumer)
    calib = calibration.Calibration.load(folder, pair)
    calib.rate = rate.measure(pair, calib, cmd.windows)
    calib.stats["seconds_rate"] = round(calib.rate.seconds, 1)
    out = folder
    if _in_assets(folder) and not cmd.maintainer:  # shipped artefacts are read-only: the result is a new run
        out = runs.new("calibrations", runs.auto_name(f"{folder.name}-rate"))
    calib.save(out)
    print(f"rate curves of {len(calib.rate.bits)} code precisions x ranks 0..{calib.rate.err_k.shape[2] - 1}, "
          f"{len(calib.rate.patch_layers)} patch layers, measured on {calib.rate.n_windows} windows in "
          f"{calib.rate.seconds:.0f} s; saved into {out}")


def _calibration_stage(cmd: Distil, stage: str):
    """(pair, calibration, output folder) of a stage added to a calibration (``distil``): the given
    calibration or the consumer's own, and a new run named ``<calibration>-<stage>`` unless told otherwise."""
    from scdviz.models.pair import choose_threads, load_pair
    from scdviz.scd import calibration

    folder = Path(cmd.calib) if cmd.calib else _calib_folder(cmd.consumer)
    print(f"torch threads: {choose_threads()}")
    pair = load_pair(cmd.producer, cmd.consumer)
    calib = calibration.Calibration.load(folder, pair)
    name = cmd.name or runs.auto_name(f"{folder.name}-{stage}")
    return pair, calib, _out_folder(cmd.out, "calibrations", name, cmd.maintainer, None)


def _distil(cmd: Distil) -> None:
    from scdviz.scd import distil

    if cmd.prepare_part:
        return _distil_prepare(cmd)
    pair, calib, out = _calibration_stage(cmd, "distil")
    work = Path(cmd.work) if cmd.work else runs.folder("distil-work", out.name)
    print(f"checkpoint in {work}: the same command with --work {work} resumes this fit if it stops")
    t0 = time.perf_counter()
    trained, log = distil.distil(pair, calib, cmd.distil, folder=work, spool=cmd.spool)
    trained.save(out)
    _save_run(cmd, out, "distil", cmd.distil.seed, str(pair.device), time.perf_counter() - t0)
    kl, best = log["val_kl"], log["best_epoch"]
    what = ("objective (KL; quoted tokens: NLL less the oracle's)" if cmd.distil.recall and
            cmd.distil.recall_target == "quote" else "KL")
    print(f"validation {what} (calib split, {log['val_windows']} windows), mean of {len(log['plans'])} plans: "
          f"closed form {kl[0]:.4f}, best {kl[best]:.4f} at validation {best} of {len(kl) - 1} (step "
          f"{log['best_step']}); training between validations " + ", ".join(f"{x:.4f}" for x in log["train_kl"]))
    for name, by in log["val_kl_by_plan"].items():
        print(f"  {name}: {by[0]:.4f} -> {by[best]:.4f}")
    if not best:
        print("no epoch beat the closed form: what is saved is the closed form, unchanged (its tag too)")
    f = log["footprint"]
    print(f"the correction stage: {f['layers']} of {f['of_layers']} layers, {f['mb']:.2f} MB (int8 factors), "
          f"{f['flops_per_token'] / 1e3:.0f} kFLOP per received token ({100 * f['of_prefill']:.2f}% of the "
          f"consumer's prefill)")
    print(f"saved to {out} in {log['seconds']:.0f} s; measure it with python -m scdviz bench scd --consumers "
          f"{cmd.consumer} --calibs {out}")


def _distil_prepare(cmd: Distil) -> None:
    """``distil --prepare-part I N``: one share of the spool's windows, nothing else."""
    from scdviz.models.pair import choose_threads, load_pair
    from scdviz.scd import calibration, distil

    if len(cmd.prepare_part) != 2 or not cmd.spool:
        raise ValueError("--prepare-part takes two numbers, I N, and needs --spool (the folder the fit will read)")
    print(f"torch threads: {choose_threads()}")
    pair = load_pair(cmd.producer, cmd.consumer)
    calib = calibration.Calibration.load(Path(cmd.calib) if cmd.calib else _calib_folder(cmd.consumer), pair)
    calib = calib.closed_form()
    t0 = time.perf_counter()
    train, val = distil.prepare(pair, calib, cmd.distil, distil.trained_plans(calib, cmd.distil), Path(cmd.spool),
                                True, tuple(cmd.prepare_part))
    print(f"part {cmd.prepare_part[0]} of {cmd.prepare_part[1]} of {len(train)} training and {len(val)} validation "
          f"windows prepared into {cmd.spool} in {time.perf_counter() - t0:.0f} s")


def _bench_scd(cmd: BenchScd) -> None:
    from scdviz.models import builtin
    from scdviz.models.pair import load_pair
    from scdviz.scd import bench, calibration

    consumers = cmd.consumers or [f"builtin:{s}" for s in builtin.specialists()]
    if not consumers:
        raise ValueError("no consumer given and no built-in specialist installed")
    folders = cmd.calibs or [str(_calib_folder(c)) for c in consumers]
    if len(folders) != len(consumers):
        raise ValueError("give one --calibs folder per --consumers source")
    parts, reports = [], []

    def show(report) -> None:
        n = report.methods[0].n_prompts
        seen = "held out of" if report.domain not in report.calibrated_on else "in"
        print(f"\n== {report.specialist} on {report.domain} ({seen} the calibration's domains; {n} prompts of "
              f"{cmd.bench.prompt_len} tokens + {cmd.bench.cont_len}) ==")
        print(protocol.show(report.table()))
        for model in dict.fromkeys(p["model"] for p in report.projection):
            proj = [p for p in report.projection if p["model"] == model and p["gpu"] == bench.PROJECTION_GPU.name
                    and p["link_gbps"] == 10]
            print(f"analytic projection (not measured) for {model}: {bench.PROJECTION_GPU.name}, "
                  f"{bench.PROJECTION_TOKENS} tokens, 10 Gbit/s: "
                  + ", ".join(f"{p['method']} {p['speedup']:.2f}x" for p in proj))
        reports.append(report)

    t0 = time.perf_counter()
    for consumer, folder in zip(consumers, folders):
        pair = load_pair(cmd.producer, consumer)
        parts.append(bench.run(cmd.bench, pair, calibration.Calibration.load(folder, pair), on_report=show))
    print("\n== per domain: raw reuse vs SCD full, same token-0 handling (ratio_ci: paired bootstrap over passages) ==")
    print(protocol.show(bench.domain_table(reports)))
    if cmd.bench.sweeps:
        print("\n== patch-budget sweep: KL at k patch layers, relative to k = 0 "
              "(vs_k0_ci95: paired bootstrap over passages) ==")
        print(protocol.show(bench.patch_table(reports)))
    if cmd.bench.budgets:
        print("\n== budget sweep: transform-coded and rate-distortion plans (both a hard byte limit) and rank-only "
              "allocation, KL relative to raw reuse (vs_raw_ci95: paired bootstrap over passages) ==")
        print(protocol.show(bench.budget_table(reports)))
    qa_rows = bench.qa_table(reports)
    if len(qa_rows):
        print(f"\n== context-QA token-F1, {qa_rows['items'].iloc[0]} items pooled over the reports (95% bootstrap; "
              "of_oracle: the share of the oracle's F1 kept, paired) ==")
        print(protocol.show(qa_rows))
    _write(cmd, protocol.merge(parts, seconds=time.perf_counter() - t0))


def _train_policy(cmd: TrainPolicy) -> None:
    from scdviz.evict import train
    from scdviz.models import hf
    from scdviz.models.pair import choose_threads, load_model

    if cmd.resume and not (cmd.name or cmd.train.out):
        raise ValueError("--resume continues a run: name it with --name (or --out)")
    if cmd.resume:
        folder = _check_writable(Path(cmd.train.out or runs.folder("policies", cmd.name)), cmd.maintainer)
    else:
        folder = _out_folder(cmd.train.out, "policies", cmd.name or runs.auto_name("policy"), cmd.maintainer, None)
    cfg = dataclasses.replace(cmd.train, out=str(folder))
    train.run_folder(cfg, cmd.resume)  # refuse a bad --out before loading a model
    print(f"torch threads: {choose_threads()}")
    model, tokenizer = load_model(cmd.model)
    state = train.load_checkpoint(folder, hf.device_of(model)) if cmd.resume else None
    t0 = time.perf_counter()
    # train writes nothing: every checkpoint (policy, best, optimizer, log) is written here, as it comes
    log = train.train(cfg, (model, tokenizer, cmd.model), train.checkpoints_to(folder), state=state).log
    _save_run(cmd, folder, "train-policy", cfg.seed, str(next(model.parameters()).device), time.perf_counter() - t0)
    best = min(log["val"], key=lambda v: v["kl"]) if log["val"] else None
    print(f"done in {log['seconds']} s; heuristic val KL {log['val_heuristic']}; best val KL {best}")
    print(f"policy saved to {folder}; bench it with: "
          f"python -m scdviz bench evict --policies {folder / 'best.safetensors'}")


def _fit_student(cmd: FitStudent) -> None:
    from scdviz.evict import student_fit
    from scdviz.models.pair import choose_threads, load_model

    folder = _out_folder(cmd.fit.out, "policies", cmd.name or runs.auto_name("student"), cmd.maintainer, None)
    work = Path(cmd.work) if cmd.work else runs.folder("fit-work", folder.name)
    print(f"checkpoint in {work}: the same command with --work {work} resumes this fit if it stops")
    print(f"torch threads: {choose_threads()}")
    model, tokenizer = load_model(cmd.model)
    t0 = time.perf_counter()
    fitted = student_fit.fit(dataclasses.replace(cmd.fit, out=str(folder)), (model, tokenizer, cmd.model),
                             folder=work)
    fitted.save(folder)
    student_fit.remove_checkpoint(work)  # the student is saved: the checkpoint and spool are not needed
    _save_run(cmd, folder, "fit-student", None, str(next(model.parameters()).device), time.perf_counter() - t0)
    log = fitted.log
    print(f"validation KL ({cmd.fit.val_contexts} calib contexts, kept {', '.join(map(str, cmd.fit.keeps))}): "
          f"H2O {log['val_heuristic']}" + (f"; while decoding: H2O {log['val_decode_heuristic']}"
                                           if "val_decode_heuristic" in log else ""))
    chosen = (fitted.config.ridge, fitted.meta.get("decode_weight"), fitted.meta.get("listwise_penalty"))

    def versus(kl: float, h2o: float) -> str:  # H2O's KL can round to 0 (a model whose logits barely move)
        return f"{kl / h2o:.3f}x H2O" if h2o > 0 else "H2O's KL rounds to 0"

    for row in log["val"]:
        decoding = f", decoding {row['decode_kl']} ({versus(row['decode_kl'], log['val_decode_heuristic'])})" \
            if "decode_kl" in row else ""
        weight = f" decode weight {row['decode_weight']:g}" if "decode_weight" in row else ""
        listwise = f", then listwise, penalty {row['listwise_penalty']:g}" if "listwise_penalty" in row else ""
        here = (row["ridge"], row.get("decode_weight"), row.get("listwise_penalty"))
        print(f"  ridge {row['ridge']:g}{weight}{listwise}: {row['kl']} ({versus(row['kl'], log['val_heuristic'])})"
              f"{decoding} " + ("<- chosen" if here == chosen else ""))
    print(f"done in {log['seconds']} s; {fitted.meta['flops_per_token_layer']} FLOPs per token per layer")
    print(f"student saved to {folder}; bench it with: "
          f"python -m scdviz bench evict --policies {folder / 'best.safetensors'}")


def _bench_evict(cmd: BenchEvict) -> None:
    from scdviz.evict import bench
    from scdviz.models.pair import choose_threads, load_model

    if not cmd.models:
        raise ValueError("give at least one model source (--models)")
    print(f"torch threads: {choose_threads()}")
    models = [(*load_model(source), source) for source in dict.fromkeys(cmd.models)]
    record = bench.run(cmd.eval, models[0], models[1:])
    print(protocol.show(bench.table(record.rows)))
    if len(per_domain := bench.domain_table(record.rows)):
        print("\nper domain: the policy chosen on validation vs the best baseline on that domain's contexts")
        print(bench.domain_text(per_domain))
    _write(cmd, record)


def _bench_ttft(cmd: BenchTtft) -> None:
    import pandas as pd

    from scdviz.models.pair import load_pair
    from scdviz.scd import calibration, ttft

    pair = load_pair(cmd.producer, cmd.consumer)
    calib = calibration.Calibration.load(cmd.calib or _calib_folder(cmd.consumer), pair)
    t0 = time.perf_counter()
    table = ttft.run(cmd.ttft, pair, calib)
    c = cmd.ttft
    print(f"\n== time to first token, {c.prompt_len}-token prompts, {c.limit} prompts x {c.reps} interleaved rounds "
          f"after {c.warmup} warm-up, medians; device {pair.device}, {calibration.specialist_name(cmd.consumer)} ==")
    print(f"oracle (consumer prefill + first step): {table['oracle_ms'].iloc[0]} ms; producer prefill: "
          f"{table['producer_prefill_ms'].iloc[0]} ms")
    with pd.option_context("display.width", 250, "display.max_columns", 40):
        steps = ["method", "bytes_per_token", "encode_ms", "receive_ms", "first_step_ms", "compute_iqr_ms"]
        if table["receive_vs_closed_form"].notna().any():  # a trained correction stage: its added receive time
            steps.append("receive_vs_closed_form")
        print(table[steps].iloc[1:].to_string(index=False))
        for label, what in (("", "without the producer's prefill"), ("_with_prefill", "with the producer's prefill"),
                            (f"_shared{c.fan_out}", f"with the producer's prefill shared by {c.fan_out} specialists")):
            cols = [f"ttft{label}_{g:g}gbps_ms" for g in ttft.BANDWIDTHS] + [f"break_even{label}_gbps"]
            print(f"\nTTFT (ms) {what}; break-even: the slowest link (Gbit/s) at which the method still "
                  f"beats the oracle")
            print(table[["method", *cols]].iloc[1:].to_string(index=False))
    _write(cmd, protocol.record("ttft", table.to_dict("records"), {}, c.seed, str(pair.device),
                                time.perf_counter() - t0))


def _bench_cost(cmd: BenchCost) -> None:
    import pandas as pd

    from scdviz.evict import cost
    from scdviz.models import hf
    from scdviz.models.pair import choose_threads, load_model

    print(f"torch threads: {choose_threads()}")
    model, tokenizer = load_model(cmd.model)
    t0 = time.perf_counter()
    rows = cost.run(cmd.cost, model, tokenizer)
    c = cmd.cost
    print(f"\n== cost of every eviction method at {c.keep:g} kept: {c.rounds} interleaved rounds after {c.warmup} "
          f"warm-up, medians; the full cache is a plain SDPA prefill ==")
    cols = ["context_len", "method", "prefill_ms", "added_ttft_ms", "prefill_ratio", "decode_ms_per_token",
            "throughput_vs_full", "evicting_ms_per_token", "added_ms_per_token", "cannot_run"]
    table = pd.DataFrame(rows)
    with pd.option_context("display.width", 250, "display.max_columns", 40):
        print(protocol.show(table[[col for col in cols if col in table]]))
    _write(cmd, protocol.record("cost", rows, {}, c.seed, str(hf.device_of(model)), time.perf_counter() - t0))


# ----------------------------------------------------------------------------- where runs write


def _in_assets(path: Path) -> bool:
    return Path(path).expanduser().resolve().is_relative_to(settings.ASSETS_DIR.resolve())


def _check_writable(path: Path, maintainer: bool) -> Path:
    """``path``, unless it lies in the repository's assets/ and --maintainer was not given."""
    if _in_assets(path) and not maintainer:
        raise ValueError(f"{path} is inside the shipped assets/ folder, which only --maintainer writes; "
                         "leave out --out to write into the runs folder")
    return Path(path).expanduser()


def _refuse_shipped_outputs(cmd) -> None:
    """Raise (``_check_writable``) when a command's --out or --figures lies in the shipped assets/ without
    --maintainer."""
    for name in ("out", "figures"):
        if getattr(cmd, name, None):
            _check_writable(Path(getattr(cmd, name)), getattr(cmd, "maintainer", False))


def _out_folder(out: str | None, kind: str, name: str, maintainer: bool, shipped: Path | None) -> Path:
    """Where a run writes: --out, else the shipped place with --maintainer, else a new ``<runs>/<kind>/<name>``."""
    if out:
        path = _check_writable(Path(out), maintainer)
        path.mkdir(parents=True, exist_ok=True)
        return path
    if maintainer and shipped is not None:
        shipped.mkdir(parents=True, exist_ok=True)
        return shipped
    return runs.new(kind, name)


def _save_config(settings_: dict, path: Path, command: str) -> str:
    """``config.toml`` of a run, headed by the command that reruns it (returned)."""
    rerun = f"python -m scdviz {command} --config {path}"
    path.write_text(config.to_toml(settings_, rerun))
    return rerun


def _save_run(cmd, folder: Path, command: str, seed: int | None, device: str, seconds: float) -> None:
    """The run's config (rerun it with --config) and provenance beside its results."""
    settings_ = config.to_dict(cmd)
    _save_config(settings_, folder / "config.toml", command)
    (folder / "run.json").write_text(json.dumps(records.run_info(settings_, seed, device, seconds, command), indent=1))


def _write(cmd, record: records.BenchRecord) -> None:
    """The bench record (its settings: the command's), its config (``.toml``) and, with --figures, its figures."""
    record.settings, kind, rows = config.to_dict(cmd), record.kind, record.rows
    if cmd.out:
        path = _check_writable(Path(cmd.out), cmd.maintainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        toml = path.parent / f"{records.stem(path)}.toml"
    else:
        folder = runs.new("bench", cmd.name or runs.auto_name(kind))
        path, toml = folder / "record.json", folder / "config.toml"
    records.write(record, path)
    rerun = _save_config(record.settings, toml, f"bench {kind}")
    print(f"wrote {len(rows)} rows to {path} (rerun: {rerun})")
    if getattr(cmd, "figures", None):
        from scdviz import figures, plots

        written = figures.export(plots.record_figures([(path.parent.name if path.name == "record.json" else path.stem,
                                                        record)]), _check_writable(Path(cmd.figures), cmd.maintainer))
        print(f"wrote {len(written)} figure files to {cmd.figures}")


def _report(cmd: Report) -> None:
    from scdviz import report

    if cmd.tables:  # print the named tables
        for name in cmd.tables:
            print(f"<!-- table:{name} -->\n{report.render(name)}\n<!-- /table:{name} -->")
        return
    files = report.doc_files(cmd.root)
    if cmd.check:
        if stale := report.stale(files):
            print("\n".join(["docs differ from the shipped records (run `python -m scdviz report`):", *stale]))
            raise SystemExit(1)
        print(f"every marked table in {len(files)} files matches the shipped records")
        return
    changed = report.update(files)
    print(f"rewrote the marked tables of {len(changed)} of {len(files)} files" +
          "".join(f"\n  {p}" for p in changed))


# name, help, settings dataclass (None: no flags), function
COMMANDS = [
    ("app", "start the web app (settings from SCDVIZ_* / GRADIO_SERVER_* variables)", None, _app),
    ("download", "fetch and convert the built-in producer (first use)", None, _download),
    ("pair-info", "print a pair's facts; --eval adds perplexity and drift", PairInfo, _pair_info),
    ("finetune", "train a LoRA specialist on your text (--texts) or a shipped corpus", Finetune, _finetune),
    ("model-card", "measure a built-in specialist and write its model card (maintainers)", ModelCard, _model_card),
    ("prepare-text", "rebuild assets/text from Debian's text packages (maintainers)", PrepareText, _prepare_text),
    ("calibrate", "fit an SCD calibration (codes, aligners, patch layers) for a pair", Calibrate, _calibrate),
    ("train-policy", "train the DistillCache eviction policy (REINFORCE)", TrainPolicy, _train_policy),
    ("fit-student", "fit the distilled scorer (a linear scorer on each layer's input) to the future's attention",
     FitStudent, _fit_student),
    ("distil", "train an SCD calibration's correction stage through the consumer on its continuation KL",
     Distil, _distil),
    ("rate", "measure an SCD calibration's rate-distortion curves for the budget planner (saved into it)", Rate, _rate),
    ("bench scd", "every SCD method and baseline on held-out text", BenchScd, _bench_scd),
    ("bench ttft", "time to first token of every SCD method and baseline vs the consumer's own prefill "
                   "(interleaved medians)",
     BenchTtft, _bench_ttft),
    ("bench evict", "learned eviction vs kvpress baselines (KL, top-1, PPL, wins)", BenchEvict, _bench_evict),
    ("bench cost", "what every eviction method costs: added time to first token and per decoded token, decode "
                   "throughput vs the full cache (one run, interleaved medians)", BenchCost, _bench_cost),
    ("report", "write the docs' results tables (marked blocks of README.md, docs/) from the shipped records",
     Report, _report),
]


def parser() -> argparse.ArgumentParser:
    """The argparse tree of COMMANDS (``bench scd`` is the ``scd`` subcommand of ``bench``)."""
    top = argparse.ArgumentParser(prog="python -m scdviz", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, help_text, fields_, fn in COMMANDS:
        where = sub
        if " " in name:
            group, name = name.split(" ", 1)
            if group not in groups:
                groups[group] = sub.add_parser(
                    group, help="benchmarks that print tables and write records"
                ).add_subparsers(dest=group, required=True)
            where = groups[group]
        p = where.add_parser(name, help=help_text, description=help_text,
                             epilog=f"model sources: {SOURCE_HELP}. Runs go to <runs>/<kind>/<name>, runs = "
                                    f"{runs.root()} here.")
        if fields_ is not None:
            config.add_arguments(p, fields_)
            p.add_argument("--config", metavar="FILE", default=None,
                           help="a TOML file of these settings (as each run saves in config.toml); flags given "
                                "here override it")
        p.set_defaults(fn=fn, settings=fields_, parser=p)
    return top


# settings that name files or folders: a relative path that exists is made absolute before the run, so
# the saved config reruns from any working folder
PATH_FIELDS = frozenset({"texts", "producer", "consumer", "consumers", "calib", "calibs", "policies", "model", "models",
                         "base"})


def _absolute_paths(cmd) -> None:
    def fix(value):
        if isinstance(value, str) and value and not Path(value).is_absolute() and Path(value).exists():
            return str(Path(value).resolve())
        return value

    for f in dataclasses.fields(cmd):
        value = getattr(cmd, f.name)
        if dataclasses.is_dataclass(value):
            _absolute_paths(value)
        elif f.name in PATH_FIELDS:
            setattr(cmd, f.name, type(value)(fix(v) for v in value) if isinstance(value, (list, tuple)) else fix(value))


def _seed(cmd) -> int | None:
    """The run's seed: the first ``seed`` field in its settings (nested configs included)."""
    todo = [cmd]
    while todo:
        obj = todo.pop(0)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name == "seed":
                return value
            if dataclasses.is_dataclass(value):
                todo.append(value)
    return None


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's global generators (each method also seeds its own)."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def main(argv: list[str] | None = None) -> int:
    records.loaded_commit()  # the commit this run's records name: the code as it starts (a long run outlives edits)
    top = parser()
    try:
        args = top.parse_args(argv)
    except SystemExit as done:  # --help, or a flag argparse refused (it printed why)
        return int(done.code or 0)
    from scdviz.models.pair import PairError

    try:
        if getattr(args, "config", None):  # the file's settings become defaults; flags on the command line win
            args.parser.set_defaults(**config.read_toml(args.settings, args.config))
            args = top.parse_args(argv)
        cmd = config.from_args(args.settings, args) if args.settings is not None else None
        if cmd is not None:
            _absolute_paths(cmd)
            _refuse_shipped_outputs(cmd)  # before any work: a long run must not end on a refused path
            if (seed := _seed(cmd)) is not None:
                seed_everything(seed)
        args.fn(cmd)
    except (PairError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0

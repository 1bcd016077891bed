"""The SCD benchmark of one pair: the method lineup, the sweeps, JSON records, a projection.

``bench(pair, calib, windows, cfg)`` runs oracle, raw KV, 4-bit KV, DroidSpeak-style
recompute, SCD reuse-only and SCD full on the same held-out windows (with greedy
generation for token-F1), optionally the patch-budget sweep (k = 0..patch_k, selected vs
drift placement) and a rank (byte-budget) sweep, and an analytic projection of each
method's TTFT for named large models (scdviz.link). A calibration with a trained correction
stage (scdviz.scd.distil) has every SCD plan measured again with its closed form, labelled
``plans.CLOSED``, on the same windows: before and after training side by side. ``rows`` flattens a report into the
rows of ``python -m scdviz bench scd`` (written as a scdviz.records.BenchRecord). No argument parsing here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from scdviz import config, data, metrics, protocol, qa
from scdviz import link as links
from scdviz.config import opt
from scdviz.models import builtin
from scdviz.models.pair import Pair
from scdviz.progress import Reporter
from scdviz.records import BenchRecord
from scdviz.scd import calibrate as cal
from scdviz.scd import calibration, distil, measure, rate
from scdviz.scd import plan as plans
from scdviz.scd.plan import Plan

CODERS = ("transform", "rd")  # how a byte budget becomes a plan (budget_plan)


@dataclass
class ScdBenchConfig:
    """One SCD benchmark run on held-out text."""

    texts: str | None = opt(None, "your text (.txt / .jsonl file, or a folder of train/calib/eval files); its eval "
                            "split is measured instead of the shipped ones")
    domains: list[str] = opt([], "shipped corpora whose eval splits are measured, one report each (default: the "
                             "specialist's own training corpus, else every calibration domain)")
    lodo: bool = opt(False, "leave-one-domain-out: for each calibration domain (or each of --domains), calibrate again "
                     "without it (same settings; a trained correction stage is trained again with its own recipe, "
                     "and its closed form measured beside it) and measure on its eval split")
    slice: str = opt("dev", "the slice of each eval split measured (scdviz.data): dev while you iterate; test only "
                     "for the final run of a shipped artefact, from a clean committed tree", choices=data.SLICES)
    limit: int = opt(16, "prompts per domain, spread evenly through the slice")
    prompt_len: int = opt(256, "prompt tokens per window")
    cont_len: int = opt(32, "teacher-forced continuation tokens")
    gen_tokens: int = opt(32, "greedy tokens per method for token-F1 (0: skip)")
    sweeps: bool = opt(False, "also the patch-budget sweep k = 0..patch_k (selected vs drift placement)")
    budgets: tuple[float, ...] = opt((), "budget sweep: payload bytes/token budgets (transform-coded and "
                                     "rate-distortion plans, and rank-only allocation beside them)")
    tails: list[int] = opt([], "the tail sweep: raw KV (CacheBlend's way), SCD reuse-only and SCD transform coded at "
                           "each --budgets, each with the consumer recomputing the last this-many prompt tokens "
                           "itself over the received cache (e.g. 16 32 64); KL against bytes and against the "
                           "consumer's compute (prefill_share)")
    budget: float | None = opt(None, "SCD full = the --coder plan at this many payload bytes/token, a hard limit "
                               "(default: the calibration's operating point)")
    coder: str = opt("transform", "the plan --budget makes: transform (full-rank codes, one uniform step per section "
                     "scaled by its measured KL sensitivity, entropy coded; the rank follows from the step) or rd "
                     "(ranks, bits and patches chosen on the rate-distortion curves)", choices=CODERS)
    sent_rows: bool = opt(True, "also every method with the producer's token 0 sent instead of recomputed (extra "
                          "rows)")
    qa_answer_len: int = opt(qa.ANSWER_LEN, "context-QA: answer tokens of the question asked about each prompt "
                             "(0: no QA)")
    qa_kind: str | None = opt(None, "context-QA: the question asked (scdviz.qa): quote (continue a quote of the "
                              "prompt) or before (the words before a quote, nearest first); default: the task the "
                              "consumer was fine-tuned on when it is one of these, else quote", choices=qa.KINDS)
    seed: int = opt(0, "torch seed set before the run")
    work: str | None = opt(None, "with --lodo: a folder keeping each fold's calibration and its trained stage's fit "
                           "(spool and checkpoint, the spool removed once the stage is saved), so the same command "
                           "run again resumes where it stopped; default: a temporary folder")


def budget_plan(calib: calibration.Calibration, curves, budget: float, n_tokens: int, sink: str, coder: str,
                name: str | None = None) -> Plan:
    """The SCD plan for a byte budget: transform coded or rate-distortion planned (both a hard limit)."""
    if coder == "transform":
        return plans.tc_plan(dataclasses.replace(calib, rate=curves), budget, sink, name)
    if coder == "rd":
        return plans.rd_plan(curves, budget, n_tokens, sink, name)[0]
    raise ValueError(f"unknown coder {coder!r}; use one of {CODERS}")


PROJECTION_TOKENS = 4096  # prompt length of the projection
PROJECTION_GPU = links.GPUS[1]  # H100-SXM, the one the CLI prints (records hold every GPU)


@dataclass
class BenchReport:
    """Everything one benchmark run measured for one specialist."""

    specialist: str  # consumer label
    methods: list[measure.MethodResult]  # oracle first, then the lineup
    sweeps: list[measure.MethodResult] = field(default_factory=list)  # patch-budget and rank sweeps
    projection: list[dict] = field(default_factory=list)  # analytic projection rows
    plans: dict[str, Plan] = field(default_factory=dict)  # method label -> plan
    domain: str = ""  # the text measured ("texts" for a user's file)
    passages: list[str] = field(default_factory=list)  # the passage each prompt starts in (bootstrap clusters)
    calibrated_on: list[str] = field(default_factory=list)  # domains the calibration saw

    def table(self) -> pd.DataFrame:
        """Methods and sweeps as one tidy table."""
        return measure.table(self.methods + self.sweeps)


def consumer_flops_per_token(plan: Plan, calib: calibration.Calibration, small_d_kv: int,
                             big: links.ModelShape) -> float:
    """Consumer FLOPs per prompt token of ``plan`` scaled to model ``big`` (ranks scale with d_kv)."""
    d_kv = big.kv_heads * big.head_dim
    per_layer = []
    for layer, mode in enumerate(plan.modes):
        if mode == "code":
            ratio = (plan.rank_k[layer] + plan.rank_v[layer]) / (2 * small_d_kv)
            per_layer.append(2 * 2 * ratio * d_kv * d_kv)  # decode K and V codes
        elif mode == "patch":
            per_layer.append(2 * big.hidden**2 + 2 * big.hidden * 2 * d_kv)  # linear aligner, k/v proj
        elif mode == "recompute":
            per_layer.append(2 * big.params / big.layers)
        else:
            per_layer.append(0.0)
    return sum(per_layer) * big.layers / len(plan.modes)


def pair_shape(pair: Pair) -> links.ModelShape:
    """The loaded consumer's own shape, named after it: the projection's first model."""
    f = pair.consumer_facts
    return links.ModelShape(f"this pair ({calibration.specialist_name(pair.consumer_source)}, {f.params / 1e6:.3g}M)",
                            f.layers, f.kv_heads, f.head_dim, f.hidden, float(f.params))


def projection(report: BenchReport, calib: calibration.Calibration, small_d_kv: int,
               own: links.ModelShape | None = None) -> list[dict]:
    """Projected TTFT speed-up of every method on the pair's own shape (``own``) and each named preset
    (Mistral-7B, Llama-3-8B, Qwen-32B), each GPU, 10 and 100 Gbit/s."""
    rows = []
    for res in report.methods:
        if res.method == "oracle":
            continue
        for big in ([own] if own else []) + list(links.LARGE_MODELS):
            flops = consumer_flops_per_token(report.plans[res.method], calib, small_d_kv, big)
            for gpu in links.GPUS:
                for link in (links.Link(10), links.Link(100)):
                    row = links.project(big, gpu, PROJECTION_TOKENS, res.compression_vs_fp16, flops, link)
                    rows.append({"method": res.method, **row})
    return rows


def bench(
    pair: Pair,
    calib: calibration.Calibration,
    windows: list[list[int]],
    cfg: ScdBenchConfig,
    specialist: str | None = None,
    progress: bool | Reporter = True,
    scd_full: Plan | None = None,
) -> BenchReport:
    """Run the lineup (and sweeps) on ``windows`` with ``cfg``'s settings; see the module docstring.

    scd_full: the SCD plan in the lineup (default: the calibration's operating point).
    cfg.budget: SCD full is instead the ``cfg.coder`` plan at this many bytes/token (``budget_plan``).
    cfg.budgets: the transform-coded plan, the rate-distortion plan (packed and entropy coded) and the
    rank-only allocation at each ("budget sweep"). Both use the calibration's rate curves, measured now
    when it has none. Every method of the lineup recomputes token 0 at the consumer; cfg.sent_rows: the
    lineup again with the producer's token 0 sent, as the "token 0" group. (cfg's texts, domains, lodo, limit,
    prompt_len and seed choose the windows: ``reports`` reads them.)
    """
    cont_len, gen_tokens, budget, budgets, sink = cfg.cont_len, cfg.gen_tokens, cfg.budget, cfg.budgets, "recompute"
    cases = measure.prepare_cases(pair, windows, cont_len, progress, cfg.qa_answer_len, qa_kind(cfg, pair))
    n_tokens = cases[0].state.ids.shape[1]
    if any(t < 1 or t > n_tokens - 1 for t in cfg.tails):  # a tail leaves token 0
        raise ValueError(f"a recomputed tail is 1 to {n_tokens - 1} prompt tokens for a {n_tokens + 1}-token prompt "
                         f"(token 0 stays); got {list(cfg.tails)}")
    curves = (calib.rate or rate.measure(pair, calib, progress=progress)) if budget or budgets else None
    if budget:
        scd_full = budget_plan(calib, curves, budget, n_tokens, sink, cfg.coder, name="SCD full")
    oracle, gens = measure.oracle_result(pair, cases, gen_tokens)
    lineup = plans.lineup(calib, scd_full, sink)
    lineup, calibs = plans.with_closed_form(lineup, calib)
    results = measure.run_methods(pair, calibs, cases, lineup, "method", gen_tokens, gens, progress)
    report = BenchReport(specialist or pair.consumer_source, [oracle, *results], plans={p.name: p for p in lineup},
                         calibrated_on=list(calib.stats.get("domains", [])))
    if cfg.sent_rows:
        other = plans.lineup(calib, scd_full, "send")
        report.sweeps += measure.run_methods(pair, calib, cases, other, "token 0", progress=progress)
    if cfg.sweeps:
        report.sweeps += measure.run_methods(pair, calib, cases, plans.patch_sweep(calib), "patch sweep",
                                             progress=progress)
        report.sweeps += measure.run_methods(pair, calib, cases, plans.droidspeak_sweep(calib), "DroidSpeak sweep",
                                             progress=progress)
    if cfg.tails:
        tailed, calibs = plans.with_closed_form(
            plans.tail_sweep(calib, tuple(cfg.tails), tuple(budgets) if calib.rate else ()), calib)
        report.sweeps += measure.run_methods(pair, calibs, cases, tailed, "tail sweep", progress=progress)
    if budgets:
        swept = []
        for b in budgets:
            rd = plans.rd_plan(curves, b, n_tokens, sink)[0]
            coded = dataclasses.replace(rd, name=f"SCD RD+entropy @{b:g} B/token", entropy=True)  # the same plan, coded
            swept += [budget_plan(calib, curves, b, n_tokens, sink, "transform"), rd, coded,
                      *plans.rank_sweep(calib, [b])]
        swept, calibs = plans.with_closed_form(swept, calib)
        report.sweeps += measure.run_methods(pair, calibs, cases, swept, "budget sweep", progress=progress)
    d_kv = pair.consumer_facts.kv_heads * pair.consumer_facts.head_dim
    report.projection = projection(report, calib, d_kv, pair_shape(pair))
    return report


def qa_kind(cfg: ScdBenchConfig, pair: Pair) -> str:
    """The context-QA question the bench asks: ``cfg.qa_kind``, else the consumer's fine-tuning task when it is a
    question kind (a specialist is measured on the task it was trained for), else quote."""
    return qa.kind_for(pair.consumer_source, cfg.qa_kind)


def eval_domains(cfg: ScdBenchConfig, specialist: str, calib: calibration.Calibration) -> list[str]:
    """The domains measured: the given ones, else the specialist's own corpus (a built-in's training
    corpus), else every calibration domain."""
    if cfg.texts:
        return ["texts"]
    if cfg.domains:
        return list(cfg.domains)
    own = specialist if specialist in data.corpora() else builtin.training_corpus(specialist)
    return [own] if own in data.corpora() else list(calib.stats.get("domains") or data.corpora())


def eval_windows(texts: str | None, cfg: ScdBenchConfig, pair: Pair, domain: str) -> list[data.Window]:
    """The bench's eval prompts of ``domain``: up to ``cfg.limit`` token windows of
    ``cfg.prompt_len + cfg.cont_len`` ids each, spread evenly through the ``cfg.slice`` slice of its
    eval split (or of ``texts``, the user's text), each naming the passage it starts in."""
    return data.eval_windows(pair.tokenizer, domain, cfg.slice, cfg.prompt_len + cfg.cont_len, cfg.limit, texts)


def run(cfg: ScdBenchConfig, pair: Pair, calib: calibration.Calibration | None = None, specialist: str | None = None,
        progress: bool = True, settings: dict | None = None, on_report=None) -> BenchRecord:
    """The SCD bench of one pair as a BenchRecord (kind "scd"): ``reports`` flattened by ``rows``.

    calib: default the consumer's shipped calibration. settings: the record's settings (default:
    ``cfg``'s, under "bench", as the CLI nests them). on_report(report): each report as it is measured
    (the CLI prints its tables).
    """
    protocol.check_slice(cfg.slice)
    calib = (calib if calib is not None
             else calibration.Calibration.load(calibration.shipped_folder(pair.consumer_source), pair))
    t0 = time.perf_counter()
    out = []
    for report in reports(cfg, pair, calib, specialist, progress, on_report):
        out += rows(report)
    return protocol.record("scd", out, {"bench": config.to_dict(cfg)} if settings is None else settings, cfg.seed,
                           str(pair.device), time.perf_counter() - t0)


def reports(cfg: ScdBenchConfig, pair: Pair, calib: calibration.Calibration, specialist: str | None = None,
            progress: bool = True, on_report=None) -> list[BenchReport]:
    """``bench`` on held-out eval windows, one report per domain (each also to ``on_report``).

    With ``cfg.lodo``, each domain of the calibration (or each of ``cfg.domains``) is measured
    with a calibration made again without it (the loaded calibration's settings, that domain
    left out): text the calibration never saw. Otherwise every domain is measured with ``calib`` itself.
    """
    name = specialist or calibration.specialist_name(pair.consumer_source)
    seen = list(calib.stats.get("domains") or [])
    domains = (list(cfg.domains) or seen) if cfg.lodo else eval_domains(cfg, name, calib)
    if cfg.work and not cfg.lodo:
        raise ValueError("--work keeps the folds of a leave-one-domain-out run: give it with --lodo")

    def measure_on(domain: str, used: calibration.Calibration) -> BenchReport:
        torch.manual_seed(cfg.seed)  # as a resumed run, whose folds' calibrations were read from disk, is
        windows = eval_windows(cfg.texts or calib.config.texts, cfg, pair, domain)
        report = bench(pair, used, [w.ids for w in windows], cfg, name, progress)
        report.domain, report.passages = domain, [w.cluster for w in windows]
        if on_report is not None:
            on_report(report)
        return report

    if not cfg.lodo:
        return protocol.by_domain(domains, measure_on, calib)
    with contextlib.nullcontext(cfg.work) if cfg.work else tempfile.TemporaryDirectory(prefix="scdviz-lodo-") as work:
        return protocol.by_domain(domains, measure_on, calib, seen=seen, what="calibration",
                                  fit=lambda others: refit_fold(cfg, pair, calib, others, Path(work), progress))


def refit_fold(cfg: ScdBenchConfig, pair: Pair, calib: calibration.Calibration, others: list[str], work: Path,
               progress: bool | Reporter = True) -> calibration.Calibration:
    """``calib``'s settings made again on ``others`` only, for leave-one-domain-out: its closed form, then, when
    it carries a trained correction stage, that stage trained again with its own recipe on the same domains (the
    bench then measures both, the closed form as the "(closed form)" twins).

    The fold lives in ``work``/without-DOMAIN: the closed form is saved there and read back, the stage is fitted
    in it (its spool and checkpoint: ``distil.distil``), saved and read back, so a fold is always what its files
    hold and a run stopped anywhere and run again with the same ``work`` resumes (a finished part is read, not
    made again) and measures what an uninterrupted run does. A fold folder made with other settings is refused."""
    left = [d for d in calib.stats.get("domains") or [] if d not in others]
    fold = work / f"without-{'-'.join(left)}"
    recipe = distil_recipe(calib)
    rate_windows = calib.config.rate_windows if cfg.budget or cfg.budgets or (recipe and recipe.budgets) else 0
    texts = calib.config.texts if "texts" in others else None  # the user's text stays a domain of its own
    wanted = dataclasses.replace(calib.config, domains=[d for d in others if d != "texts"], texts=texts,
                                 rate_windows=rate_windows)
    closed = _fold_part(fold / "closed-form", pair, wanted, None)
    if closed is None:
        torch.manual_seed(cfg.seed)  # seeded before the calibration, as each domain's measurement is
        cal.calibrate(wanted, pair, progress).save(fold / "closed-form")
        closed = _fold_part(fold / "closed-form", pair, wanted, None)
    if recipe is None:
        return closed
    trained = _fold_part(fold / "trained", pair, wanted, recipe)
    if trained is None:
        out, _ = distil.distil(pair, closed, recipe, progress, folder=fold / "distil")
        out.save(fold / "trained")
        shutil.rmtree(fold / "distil")  # the spool: ~5 MB a window, and the stage is saved
        trained = _fold_part(fold / "trained", pair, wanted, recipe)
    return trained


def _fold_part(folder: Path, pair: Pair, wanted: calibration.CalibConfig,
               recipe: distil.DistilConfig | None) -> calibration.Calibration | None:
    """The calibration saved in ``folder`` (None when there is none yet); ValueError when it was made with
    other settings than ``wanted`` (and, for a trained stage, ``recipe``: a fit whose validation never beat the
    closed form saved the closed form, which carries none)."""
    if not (folder / calibration.FILE).is_file():
        return None
    got = calibration.Calibration.load(folder, pair)
    if config.to_dict(got.config) != config.to_dict(wanted) or (recipe and got.corrections
                                                                 and distil_recipe(got) != recipe):
        raise ValueError(f"{folder} holds a fold made with other settings than this run's; give --work a new folder "
                         "(or remove that one)")
    return got


def distil_recipe(calib: calibration.Calibration) -> distil.DistilConfig | None:
    """The recipe of ``calib``'s trained correction stage (its log's config), None when it has none."""
    if not calib.corrections:
        return None
    saved = calib.stats.get("distil", {}).get("config")
    if saved is None:
        raise ValueError("this calibration's trained stage carries no recipe (its distil log has no config): "
                         "train it again with `python -m scdviz distil` to measure it leave-one-domain-out")
    saved = {"val_every": 0, **saved}  # a log from before --val-every validated after each epoch, its default then
    return config.from_dict(distil.DistilConfig, saved, "the calibration's distil recipe")[0]


def _clusters(report: BenchReport) -> list[str] | None:
    """The passage of each prompt, for the cluster bootstrap (None for a report made without them)."""
    return report.passages or None


def _ratio_ci(base: measure.MethodResult, other: measure.MethodResult, clusters: list[str] | None = None
              ) -> tuple[float | None, str]:
    """KL of ``other`` relative to ``base`` (same prompts) and its 95% paired-bootstrap interval, resampling
    whole passages (``clusters``, one per prompt) when given."""
    boot = metrics.paired_bootstrap(base.kl_per_prompt, other.kl_per_prompt, clusters=clusters)
    return (round(other.kl / base.kl, 3) if base.kl else None), protocol.interval(boot["ratio_ci"])


def qa_table(reports: list[BenchReport]) -> pd.DataFrame:
    """Context-QA token-F1 per method, items pooled over every report, with 95% bootstrap intervals, the paired
    difference to raw reuse and the share of the oracle's F1 it keeps (ratio of means; same items). The methods,
    the token-0 rows and the budget rows (SCD under a byte limit per token) each get one."""
    by: dict[str, list[float]] = {}
    clusters: list[str] = []
    for rep in reports:
        for r in rep.methods + [s for s in rep.sweeps if s.group in ("token 0", "budget sweep")]:
            by.setdefault(r.method, []).extend(r.qa_f1)
        clusters += rep.passages if len(rep.passages) == len(rep.methods[0].qa_f1) else []
    if not by.get("raw KV"):
        return pd.DataFrame()
    groups = clusters if len(clusters) == len(by["raw KV"]) else None
    out = []
    for method, items in by.items():
        if len(items) != len(by["raw KV"]):
            continue
        own = metrics.bootstrap_mean(items, clusters=groups)
        vs = metrics.paired_bootstrap(by["raw KV"], items, clusters=groups)
        share = (metrics.paired_bootstrap(by["oracle"], items, clusters=groups)
                 if len(by.get("oracle", [])) == len(items) and sum(by["oracle"]) else None)
        out.append({"method": method, "qa_f1": round(own["mean"], 3),
                    "ci95": protocol.interval(own["ci"]),
                    "minus_raw": round(vs["diff"], 3), "minus_raw_ci95": protocol.interval(vs["diff_ci"]),
                    "of_oracle": None if share is None else round(share["ratio"], 3),
                    "of_oracle_ci95": None if share is None else protocol.interval(share["ratio_ci"]),
                    "items": len(items)})
    return pd.DataFrame(out)


def patch_table(reports: list[BenchReport]) -> pd.DataFrame:
    """The patch-budget sweep per report: KL ± se and top-1 at each k, and KL relative to k = 0
    (reuse-only, same placement) with its 95% paired-bootstrap interval (over passages)."""
    out = []
    for rep in reports:
        sweep = [r for r in rep.sweeps if r.group == "patch sweep"]
        for placement in sorted({r.method.split("(")[-1].rstrip(")") for r in sweep}):
            rows_ = [r for r in sweep if r.method.endswith(f"({placement})")]
            base = rows_[0]
            for r in rows_:
                ratio, ci = _ratio_ci(base, r, _clusters(rep))
                out.append({"specialist": rep.specialist, "domain": rep.domain, "placement": placement,
                            "k": int(r.method.split("k=")[1].split()[0]), "kl": round(r.kl, 4),
                            "kl_se": round(r.kl_se, 4),
                            "top1": round(r.top1, 3), "vs_k0": ratio, "vs_k0_ci95": ci,
                            "bytes": round(r.payload_bytes_per_token), "n": r.n_prompts})
    return pd.DataFrame(out)


def budget_table(reports: list[BenchReport]) -> pd.DataFrame:
    """The budget sweep per report: each plan's real bytes/token, KL ± se and top-1, and its KL
    relative to raw reuse (same prompts and token-0 handling) with a 95% paired-bootstrap interval."""
    out = []
    for rep in reports:
        raw = next(r for r in rep.methods if r.method.startswith("raw KV"))
        for r in (r for r in rep.sweeps if r.group == "budget sweep"):
            ratio, ci = _ratio_ci(raw, r, _clusters(rep))
            out.append({"specialist": rep.specialist, "domain": rep.domain, "method": r.method,
                        "bytes": round(r.payload_bytes_per_token, 1), "kl": round(r.kl, 4), "kl_se": round(r.kl_se, 4),
                        "top1": round(r.top1, 3), "vs_raw": ratio, "vs_raw_ci95": ci, "n": r.n_prompts})
    return pd.DataFrame(out)


def domain_table(reports: list[BenchReport]) -> pd.DataFrame:
    """Per domain: raw reuse vs SCD full (KL ± se, ratio, top-1, bytes/token) with the same token-0 handling,
    on how many prompts SCD's KL is above raw's, and the continuation perplexity of the real text under
    the oracle, raw reuse and SCD. KL measures fidelity to the consumer's own prefill; perplexity
    measures how well the transferred cache predicts the text, which can differ (off-domain SCD can
    be closer to the consumer and still predict the text worse than raw reuse)."""
    rows_ = []
    for rep in reports:
        by = {r.method: r for r in rep.methods}
        raw = next(r for name, r in by.items() if name.startswith("raw KV"))
        four = next(r for name, r in by.items() if name.startswith("4-bit KV"))
        scd = by["SCD full"]  # the lineup's name for the operating point (its closed-form twin comes after it)
        versus = protocol.vs_best({raw.method: raw.kl_per_prompt, scd.method: scd.kl_per_prompt}, scd.method,
                                  [raw.method], min_n=1, clusters=_clusters(rep))
        rows_.append({
            "specialist": rep.specialist, "domain": rep.domain,
            "held_out": rep.domain not in rep.calibrated_on,
            "raw_kl": round(raw.kl, 4), "raw_se": round(raw.kl_se, 4), "scd_kl": round(scd.kl, 4),
            "scd_se": round(scd.kl_se, 4), "scd_over_raw": round(scd.kl / raw.kl, 3) if raw.kl else None,
            "raw_top1": round(raw.top1, 3), "scd_top1": round(scd.top1, 3),
            "scd_bytes": round(scd.payload_bytes_per_token), "4bit_bytes": round(four.payload_bytes_per_token),
            "oracle_ppl": round(scd.ppl_oracle, 2), "raw_ppl": round(raw.ppl, 2), "scd_ppl": round(scd.ppl, 2),
            "n": scd.n_prompts,
            "above_raw": versus["above"],
            "ratio_ci": protocol.interval(versus["boot"]["ratio_ci"]),
        })
    return pd.DataFrame(rows_)


def _profile(values: list[float], digits: int = 5) -> list[float]:
    """A per-layer profile as a record keeps it: ``digits`` significant digits (plots and tables read
    no more; the shipped records must fit the repository)."""
    return [float(f"{v:.{digits}g}") for v in values]


def rows(report: BenchReport) -> list[dict]:
    """JSON records: one per method / sweep point, then the projection rows (per-layer profiles to 5
    significant digits, the bytes and columns sent per layer to 1/100)."""
    out = []
    for r in report.methods + report.sweeps:
        out.append({
            "row": "measured",
            "group": r.group,
            "specialist": report.specialist,
            "domain": report.domain,
            "held_out": report.domain not in report.calibrated_on,
            "method": r.method,
            "payload_bytes_per_token": r.payload_bytes_per_token,
            "compression_vs_fp16": r.compression_vs_fp16,
            "kl": r.kl,
            "kl_se": r.kl_se,
            "top1": r.top1,
            "ppl": r.ppl,
            "ppl_oracle": r.ppl_oracle,
            "f1_vs_oracle": r.f1,
            "ttft_s_1gbps": r.ttft["1gbps"],
            "ttft_s_10gbps": r.ttft["10gbps"],
            "ttft_s_100gbps": r.ttft["100gbps"],
            "oracle_ttft_s": r.oracle_seconds,
            "speedup_vs_oracle_10gbps": r.speedup_10gbps,
            "n_prompts": r.n_prompts,
            "n_tokens": r.n_tokens,
            "modes": r.modes,
            "tail": r.tail,
            "prefill_share": r.prefill_share,
            "drift_k": _profile(r.drift_k),
            "drift_v": _profile(r.drift_v),
            "divergence": _profile(r.divergence),
            "amplification": _profile(r.amplification()),
            "qa_f1": sum(r.qa_f1) / len(r.qa_f1) if r.qa_f1 else None,
            "qa_f1_items": r.qa_f1,
            "kl_per_prompt": r.kl_per_prompt,
            "passages": report.passages,
            "sent": {key: [round(v, 2) for v in values] for key, values in r.sent.items()},
        })
    out += [{"specialist": report.specialist, "domain": report.domain,
             "label": "analytic projection, not a measurement", **p}
            for p in report.projection]
    return out

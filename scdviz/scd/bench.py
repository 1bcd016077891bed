"""The SCD benchmark of one pair: the method lineup, the sweeps, JSON records, a projection.

``bench(pair, calib, windows, ...)`` runs oracle, raw KV, 4-bit KV, DroidSpeak-style
recompute, SCD reuse-only and SCD full on the same held-out windows (with greedy
generation for token-F1), optionally the patch-budget sweep (k = 0..patch_k, selected vs
drift placement) and a rank (byte-budget) sweep, and an analytic projection of each
method's TTFT for named large models (scdviz.link). ``rows`` flattens a report into the
rows of ``python -m scdviz bench scd`` (written as a scdviz.records.BenchRecord). No argument parsing here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch

from scdviz import data
from scdviz import link as links
from scdviz.config import opt
from scdviz.models.pair import Pair
from scdviz.scd import calibrate as cal
from scdviz.scd import measure
from scdviz.scd import plan as plans
from scdviz.scd.plan import Plan


@dataclass
class ScdBenchConfig:
    """One SCD benchmark run on held-out text."""

    texts: str | None = opt(None, ".txt or .jsonl evaluation text (default: the specialist's shipped eval split)")
    limit: int = opt(16, "prompts")
    prompt_len: int = opt(256, "prompt tokens per window")
    cont_len: int = opt(32, "teacher-forced continuation tokens")
    gen_tokens: int = opt(32, "greedy tokens per method for token-F1 (0: skip)")
    sweeps: bool = opt(False, "also the patch-budget sweep k = 0..patch_k (selected vs drift placement)")
    budgets: tuple[float, ...] = opt((), "rank sweep: payload bytes/token budgets")
    seed: int = opt(0, "torch seed set before the run")


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

    def table(self) -> pd.DataFrame:
        """Methods and sweeps as one tidy table."""
        return measure.table(self.methods + self.sweeps)


def consumer_flops_per_token(plan: Plan, calib: cal.Calibration, small_d_kv: int, big: links.ModelShape) -> float:
    """Consumer FLOPs per prompt token of ``plan`` scaled to model ``big`` (ranks scale with d_kv)."""
    d_kv = big.kv_heads * big.head_dim
    per_layer = []
    for layer, mode in enumerate(plan.modes):
        if mode == "code":
            ratio = (plan.rank_k[layer] + plan.rank_v[layer]) / (2 * small_d_kv)
            per_layer.append(2 * 2 * ratio * d_kv * d_kv)  # decode K and V codes
        elif mode == "patch":
            hidden = calib.config.aligner_hidden / hf_hidden(calib) * big.hidden
            per_layer.append(2 * 2 * big.hidden * hidden + 2 * big.hidden * 2 * d_kv)  # aligner + k/v proj
        elif mode == "recompute":
            per_layer.append(2 * big.params / big.layers)
        else:
            per_layer.append(0.0)
    return sum(per_layer) * big.layers / len(plan.modes)


def hf_hidden(calib: cal.Calibration) -> int:
    """Hidden size of the calibrated pair."""
    return int(calib.identity["facts"]["hidden"])


def projection(report: BenchReport, calib: cal.Calibration, small_d_kv: int) -> list[dict]:
    """Projected TTFT speed-up of every method on each named large model, GPU, 10 and 100 Gbit/s."""
    rows = []
    for res in report.methods:
        if res.method == "oracle":
            continue
        for big in links.LARGE_MODELS:
            flops = consumer_flops_per_token(report.plans[res.method], calib, small_d_kv, big)
            for gpu in links.GPUS:
                for link in (links.Link(10), links.Link(100)):
                    row = links.project(big, gpu, PROJECTION_TOKENS, res.compression_vs_fp16, flops, link)
                    rows.append({"method": res.method, **row})
    return rows


def bench(
    pair: Pair,
    calib: cal.Calibration,
    windows: list[list[int]],
    cont_len: int = 32,
    gen_tokens: int = 32,
    sweeps: bool = False,
    budgets: tuple[float, ...] = (),
    specialist: str | None = None,
    progress: bool = True,
    scd_full: Plan | None = None,
) -> BenchReport:
    """Run the lineup (and sweeps) on ``windows``; see the module docstring.

    scd_full: the SCD plan in the lineup (default: the calibration's operating point).
    """
    cases = measure.prepare_cases(pair, windows, cont_len, progress)
    oracle, gens = measure.oracle_result(pair, cases, gen_tokens)
    lineup = plans.lineup(calib, scd_full)
    results = measure.run_methods(pair, calib, cases, lineup, "method", gen_tokens, gens, progress)
    report = BenchReport(specialist or pair.consumer_source, [oracle, *results], plans={p.name: p for p in lineup})
    if sweeps:
        report.sweeps += measure.run_methods(pair, calib, cases, plans.patch_sweep(calib), "patch sweep", progress=progress)
    if budgets:
        report.sweeps += measure.run_methods(pair, calib, cases, plans.rank_sweep(calib, list(budgets)), "rank sweep", progress=progress)
    d_kv = pair.consumer_facts.kv_heads * pair.consumer_facts.head_dim
    report.projection = projection(report, calib, d_kv)
    return report


def run(cfg: ScdBenchConfig, pair: Pair, calib: cal.Calibration, specialist: str | None = None) -> BenchReport:
    """``bench`` on held-out windows of ``cfg.texts`` or of the calibration corpus's eval split."""
    torch.manual_seed(cfg.seed)
    name = specialist or cal.specialist_name(pair.consumer_source)
    passages = data.read_passages(cfg.texts) if cfg.texts else data.load_split(calib.config.corpus or name, "eval")
    windows = data.token_windows(pair.tokenizer, passages, cfg.prompt_len + cfg.cont_len, cfg.limit)
    if not windows:
        raise ValueError(f"the evaluation text has no window of {cfg.prompt_len + cfg.cont_len} tokens")
    return bench(pair, calib, windows, cfg.cont_len, cfg.gen_tokens, cfg.sweeps, tuple(cfg.budgets), name)


def rows(report: BenchReport) -> list[dict]:
    """JSON records: one per method / sweep point, then the projection rows."""
    out = []
    for r in report.methods + report.sweeps:
        out.append({
            "row": "measured",
            "group": r.group,
            "specialist": report.specialist,
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
            "drift_k": r.drift_k,
            "drift_v": r.drift_v,
            "divergence": r.divergence,
            "amplification": r.amplification(),
        })
    out += [{"specialist": report.specialist, "label": "analytic projection, not a measurement", **p} for p in report.projection]
    return out


def window_of(pair: Pair, text: str, cont_len: int, max_tokens: int) -> list[int]:
    """Token ids of ``text`` as one benchmark window (prompt + continuation)."""
    if not text or not text.strip():
        raise ValueError("the prompt is empty")
    ids = pair.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < cont_len + 16:
        raise ValueError(f"the text has {len(ids)} tokens; SCD needs at least {cont_len + 16} "
                         f"(a prompt of 16+ tokens and {cont_len} continuation tokens to score)")
    if len(ids) > max_tokens:
        raise ValueError(f"the text has {len(ids)} tokens; this app accepts at most {max_tokens}")
    return list(ids)


def bench_text(pair: Pair, calib: cal.Calibration, text: str, plan: Plan, cont_len: int = 32,
               gen_tokens: int = 24, sweeps: bool = False, max_tokens: int = 1024) -> BenchReport:
    """The app's view: ``bench`` on the one window made from the user's text.

    Its last ``cont_len`` tokens are the teacher-forced continuation, so the numbers equal
    ``python -m scdviz bench scd`` on the same window and settings; ``plan`` is SCD full
    (e.g. from ``plan.user_plan``).
    """
    window = window_of(pair, text, cont_len, max_tokens)
    return bench(pair, calib, [window], cont_len, gen_tokens, sweeps, (), pair.consumer_source,
                 progress=False, scd_full=plan)

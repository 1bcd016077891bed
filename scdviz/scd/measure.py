"""SCD measurement: every plan on the same prompts, the analyses, one tidy table.

``prepare_cases`` prefills held-out windows once; ``run_methods`` runs a list of plans
(made in scdviz.scd.plan)
through the one transfer machinery and aggregates per method: payload bytes (from the
real payloads), modelled TTFT (scdviz.link) against the oracle's measured prefill,
continuation perplexity, mean KL(oracle‖method) per token, top-1 agreement, token-F1 of
greedy generation vs the oracle's, per-layer K / V drift of the cache, and the
hidden-state divergence of continuation tokens through depth. ``table`` turns results
into the pandas DataFrame shared by the CLI and the app. Plots live elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch

from scdviz import link as links
from scdviz import metrics, qa
from scdviz.models import hf
from scdviz.models.pair import Pair
from scdviz.progress import Reporter, steps
from scdviz.scd import calibration, transfer
from scdviz.scd import plan as plans


@dataclass
class MethodResult:
    """One method aggregated over the evaluation prompts."""

    method: str  # method label
    group: str  # "method" (the lineup) or a sweep name
    payload_bytes_per_token: float  # real payload bytes / prompt tokens (0 for the oracle)
    compression_vs_fp16: float  # raw fp16 KV bytes / payload bytes
    kl: float  # mean KL(oracle ‖ method) per continuation token
    kl_se: float  # standard error over prompts
    top1: float  # top-1 agreement with the oracle
    ppl: float  # teacher-forced continuation perplexity
    ppl_oracle: float  # the oracle's, same tokens
    f1: float | None  # token-F1 of greedy generation vs the oracle's (None when not generated)
    consumer_seconds: float  # mean measured consumer compute (receive + first step)
    encode_seconds: float  # mean producer-side encoding time
    oracle_seconds: float  # mean measured oracle prefill + first step
    ttft: dict[str, float]  # link label -> mean modelled TTFT in seconds
    n_prompts: int  # prompts
    n_tokens: int  # scored continuation tokens
    modes: list[str]  # the plan's per-layer modes
    drift_k: list[float] = field(default_factory=list)  # (L,) ‖K − K^oracle‖² / ‖K^oracle‖² of the cache
    drift_v: list[float] = field(default_factory=list)  # (L,) same for values
    divergence: list[float] = field(default_factory=list)  # (L+1,) ‖h_l − h_l^oracle‖ / ‖h_l^oracle‖, continuation
    prompt_tokens: float = 0.0  # mean prompt tokens carried by the payload
    generations: list[list[int]] = field(default_factory=list)  # greedy token ids per prompt (when generated)
    qa_f1: list[float] = field(default_factory=list)  # per prompt: token-F1 of the context-QA answer (when asked)
    qa_answers: list[list[int]] = field(default_factory=list)  # per prompt: that answer's greedy token ids
    kl_per_prompt: list[float] = field(default_factory=list)  # mean KL of each prompt (for paired comparisons)
    # what the payloads carried per layer (``sent_per_layer``)
    sent: dict[str, list[float]] = field(default_factory=dict)
    tail: int = 0  # prefix tokens the consumer recomputed itself (``Plan.tail``)

    @property
    def prefill_share(self) -> float:
        """The consumer's own compute as a share of its prefill's (``plan.prefill_share``, the recomputed tail
        counted as its share of the prefix tokens)."""
        return plans.prefill_share(self.modes, self.tail / self.prompt_tokens if self.prompt_tokens else 0.0)

    @property
    def speedup_10gbps(self) -> float:
        """Oracle TTFT / modelled TTFT at 10 Gbit/s."""
        return self.oracle_seconds / self.ttft["10gbps"]

    def amplification(self) -> list[float]:
        """α_l = divergence after layer l / divergence before it, (L,)."""
        d = self.divergence
        return [d[i + 1] / d[i] if d[i] > 0 else float("nan") for i in range(len(d) - 1)]


def prepare_cases(pair: Pair, windows: list[list[int]], cont_len: int, progress: bool | Reporter = True,
                  qa_answer_len: int = 0, qa_kind: str = "quote") -> list[transfer.Case]:
    """Producer prefill and oracle continuation of every window; with ``qa_answer_len`` > 0 a
    context-QA item about each prompt (scdviz.qa, a question of ``qa_kind``), asked after the transferred cache."""
    cases = []
    for i, w in enumerate(steps(windows, "prefill producer + oracle", progress)):
        case = transfer.prepare_case(pair.producer, pair.consumer, w, cont_len)
        if qa_answer_len:
            prompt = w[: len(w) - cont_len]
            case.qa_item = qa.prompt_item(pair.tokenizer, prompt, i, qa_answer_len, qa_kind)
        cases.append(case)
    return cases


def _qa(model, cache, case: transfer.Case) -> dict:
    """The greedy answer to the case's QA item from ``cache`` (``qa.answer``: its tokens and token-F1)."""
    return qa.answer(model, cache, case.qa_item, case.state.ids.shape[1])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b) ** 2).sum() / (b**2).sum().clamp_min(1e-30))


def _layer_drift(cache, case: transfer.Case) -> tuple[list[float], list[float]]:
    (mk, mv), (ok, ov) = hf.cache_kv(cache), hf.cache_kv(case.oracle_cache)
    return [_rel(m, o) for m, o in zip(mk, ok)], [_rel(m, o) for m, o in zip(mv, ov)]


def _divergence(resid: list[torch.Tensor], oracle: list[torch.Tensor]) -> list[float]:
    return [float(((r - o).norm(dim=-1) / o.norm(dim=-1).clamp_min(1e-12)).mean()) for r, o in zip(resid, oracle)]


def _mean(rows: list[list[float]]) -> list[float]:
    return [sum(col) / len(col) for col in zip(*rows)]


def run_plan_on_cases(pair, cases, plan, calib, group="method", gen_tokens=0, oracle_gen=None) -> MethodResult:
    """Run one plan on every case and aggregate (generation when gen_tokens > 0): ``run_methods`` of one."""
    return run_methods(pair, calib, cases, [plan], group, gen_tokens, oracle_gen, progress=False)[0]


def _measure(pair, case: transfer.Case, plan, calib) -> dict:
    """One plan on one case: every per-prompt measurement, and the consumer's cache (``cache``)."""
    run = transfer.run_plan(pair.consumer, case, plan, calib)
    targets = case.targets[0].to(run.logits.device)
    n_tokens = case.state.ids.shape[1]
    dk, dv = _layer_drift(run.cache, case)
    return {
        "kl": float(metrics.kl_per_token(case.oracle_logits, run.logits).mean()),
        "top1": metrics.top1_agreement(case.oracle_logits, run.logits).tolist(),
        "nll": metrics.nll_per_token(run.logits, targets).tolist(),
        "nll_oracle": metrics.nll_per_token(case.oracle_logits, targets).tolist(),
        "dk": dk, "dv": dv, "div": _divergence(run.resid, case.oracle_resid),
        "consumer": run.consumer_seconds, "encode": run.encode_seconds, "oracle": case.oracle_seconds,
        "bytes": run.payload_bytes / n_tokens, "sent": sent_per_layer(run.spans, len(plan.modes), n_tokens),
        "ttft": {lk.label: links.ttft(run.payload_bytes, run.consumer_seconds + run.encode_seconds, lk)
                 for lk in links.PRESETS},
        "qa": [] if case.qa_item is None else [_qa(pair.consumer, run.cache, case)],
        "prompt_tokens": n_tokens, "cache": run.cache,
    }


def _aggregate(plan, group: str, rows: list[dict], fp16: float) -> MethodResult:
    """One plan's per-case measurements (``_measure``, with ``gen`` / ``f1`` when generated) as its row."""
    kl_mean, kl_se = metrics.mean_se([r["kl"] for r in rows])
    top1 = [x for r in rows for x in r["top1"]]
    bpt = sum(r["bytes"] for r in rows) / len(rows)
    f1 = [r["f1"] for r in rows if "f1" in r]

    def mean(key):
        return sum(r[key] for r in rows) / len(rows)

    return MethodResult(
        method=plan.name, group=group, payload_bytes_per_token=bpt, compression_vs_fp16=fp16 / bpt,
        kl=kl_mean, kl_se=kl_se, top1=sum(top1) / len(top1),
        ppl=metrics.perplexity([x for r in rows for x in r["nll"]]),
        ppl_oracle=metrics.perplexity([x for r in rows for x in r["nll_oracle"]]), f1=sum(f1) / len(f1) if f1 else None,
        consumer_seconds=mean("consumer"), encode_seconds=mean("encode"), oracle_seconds=mean("oracle"),
        ttft={lk.label: sum(r["ttft"][lk.label] for r in rows) / len(rows) for lk in links.PRESETS},
        n_prompts=len(rows), n_tokens=len(top1), modes=list(plan.modes), drift_k=_mean([r["dk"] for r in rows]),
        drift_v=_mean([r["dv"] for r in rows]), divergence=_mean([r["div"] for r in rows]),
        prompt_tokens=mean("prompt_tokens"), generations=[r["gen"] for r in rows if "gen" in r],
        kl_per_prompt=[r["kl"] for r in rows], qa_f1=[a["qa_f1"] for r in rows for a in r["qa"]],
        qa_answers=[a["answer"] for r in rows for a in r["qa"]],
        sent={key: _mean([r["sent"][key] for r in rows]) for key in rows[0]["sent"]}, tail=plan.tail,
    )


SENT_KINDS = {"k": "k", "k_code": "k", "k_recent": "k", "v": "v", "v_code": "v", "v_recent": "v", "h_code": "h",
              "resid": "h"}


def sent_per_layer(spans, n_layers: int, n_tokens: int) -> dict[str, list[float]]:
    """Per layer, from a payload's section headers: the columns sent of K, V and H (a code's rank,
    d_kv for raw K/V, the patch's code width or d for a residual) as ``cols_k`` / ``cols_v`` /
    ``cols_h``, and the bytes per prompt token of each, headers included, as ``bytes_k`` / ``bytes_v`` /
    ``bytes_h``."""
    out = {f"{what}_{kind}": [0.0] * n_layers for what in ("cols", "bytes") for kind in "kvh"}
    for sp in spans:
        kind = SENT_KINDS[sp.kind]
        if sp.kind not in ("k_recent", "v_recent"):  # KIVI's window repeats the columns of its layer
            out[f"cols_{kind}"][sp.layer] = float(sp.cols)
        out[f"bytes_{kind}"][sp.layer] += sp.nbytes / n_tokens
    return out


def oracle_result(pair: Pair, cases: list[transfer.Case], gen_tokens: int) -> tuple[MethodResult, list[list[int]]]:
    """The oracle row (its own prefill) and its greedy generations."""
    gens = [
        hf.generate(pair.consumer, c.oracle_cache, c.fed[:, :1], c.state.ids.shape[1], gen_tokens) if gen_tokens else []
        for c in cases
    ]
    nll = [x for c in cases
           for x in metrics.nll_per_token(c.oracle_logits, c.targets[0].to(c.oracle_logits.device)).tolist()]
    orc = sum(c.oracle_seconds for c in cases) / len(cases)
    n = hf.n_layers(pair.consumer)
    # the oracle row is measured like every method: its own cache scored again through the same path
    kls, top1s, drift, div = [], [], [], []
    for c in cases:
        logits, resid = transfer.continuation(pair.consumer, c.oracle_cache, c.fed, c.state.ids.shape[1])
        kls.append(float(metrics.kl_per_token(c.oracle_logits, logits).mean()))
        top1s.append(float(metrics.top1_agreement(c.oracle_logits, logits).mean()))
        drift.append(_layer_drift(c.oracle_cache, c))
        div.append(_divergence(resid, c.oracle_resid))
    kl, kl_se = metrics.mean_se(kls)
    res = MethodResult(
        "oracle", "method", 0.0, float("nan"), kl, kl_se, sum(top1s) / len(top1s), metrics.perplexity(nll),
        metrics.perplexity(nll), 1.0 if gen_tokens else None, orc, 0.0, orc, {lk.label: orc for lk in links.PRESETS},
        len(cases), len(nll), ["own"] * n, _mean([d[0] for d in drift]), _mean([d[1] for d in drift]),
        _mean(div), sum(c.state.ids.shape[1] for c in cases) / len(cases), gens,
    )
    res.kl_per_prompt = kls
    answers = [_qa(pair.consumer, c.oracle_cache, c) for c in cases if c.qa_item is not None]
    res.qa_f1, res.qa_answers = [a["qa_f1"] for a in answers], [a["answer"] for a in answers]
    return res, gens


def run_methods(pair, calib, cases, plan_list, group="method", gen_tokens=0, oracle_gen=None,
                progress: bool | Reporter = True) -> list[MethodResult]:
    """Each plan on every case, aggregated per plan (a reporter is told each method by name). ``calib``: the
    calibration of every plan, or a list of one per plan (a trained one beside its closed form).

    Case by case: every plan's cache of one case is held until the greedy generations (gen_tokens > 0,
    token-F1 against ``oracle_gen``) are decoded from all of them in one batch, then dropped."""
    calibs = list(calib) if isinstance(calib, (list, tuple)) else [calib] * len(plan_list)
    if len(calibs) != len(plan_list):
        raise ValueError(f"{len(calibs)} calibrations for {len(plan_list)} plans")
    rows: list[list[dict]] = [[] for _ in plan_list]
    work = [(i, j) for i in range(len(cases)) for j in range(len(plan_list))]
    for i, j in steps(work, f"methods ({group})", progress, name=lambda w: plan_list[w[1]].name):
        rows[j].append(_measure(pair, cases[i], plan_list[j], calibs[j]))
        if j < len(plan_list) - 1:
            continue
        case, these = cases[i], [r[i] for r in rows]
        if gen_tokens:
            got = hf.generate_each(pair.consumer, [r["cache"] for r in these], case.fed[:, :1],
                                   case.state.ids.shape[1], gen_tokens)
            for row, gen in zip(these, got, strict=True):
                row |= {"gen": gen, "f1": metrics.token_f1(gen, oracle_gen[i])}
        for row in these:
            del row["cache"]
    fp16 = pair.consumer_facts.kv_bytes_per_token_fp16
    return [_aggregate(plan, group, r, fp16) for plan, r in zip(plan_list, rows, strict=True)]


def table(results: list[MethodResult]) -> pd.DataFrame:
    """One row per method: the tidy table shared by CLI and app."""
    rows = []
    for r in results:
        rows.append({
            "group": r.group, "method": r.method, "bytes_per_token": round(r.payload_bytes_per_token, 1),
            "compression_vs_fp16": round(r.compression_vs_fp16, 2), "kl": round(r.kl, 4), "kl_se": round(r.kl_se, 4),
            "top1": round(r.top1, 3), "ppl": round(r.ppl, 2), "ppl_oracle": round(r.ppl_oracle, 2),
            "f1": None if r.f1 is None else round(r.f1, 3), "consumer_ms": round(1000 * r.consumer_seconds, 1),
            "ttft_10gbps_ms": round(1000 * r.ttft["10gbps"], 1), "speedup_10gbps": round(r.speedup_10gbps, 2),
            "prefill_share": round(r.prefill_share, 3),
        } | ({"qa_f1": round(sum(r.qa_f1) / len(r.qa_f1), 3)} if r.qa_f1 else {}))
    return pd.DataFrame(rows)


def spectra(calib: calibration.Calibration) -> pd.DataFrame:
    """Rank spectra: per layer and K/V, the fit error (1 − explained energy) at every rank."""
    rows = []
    for kind, codes in (("K", calib.key_codes), ("V", calib.value_codes)):
        for layer, code in enumerate(codes):
            for rank, err in enumerate(code.fit_err.tolist()):
                rows.append({"layer": layer, "kind": kind, "rank": rank, "fit_err": err})
    return pd.DataFrame(rows)

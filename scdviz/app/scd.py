"""The SCD tab's work: calibrations (the visitor's or the shipped one) and every method on one text (``ScdRequest``)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from scdviz import qa, settings
from scdviz.app import inputs
from scdviz.app.inputs import UserError
from scdviz.app.pairs import builtin_choices
from scdviz.app.requests import ScdRequest
from scdviz.models.pair import Pair

_SHIPPED_CALIBS: dict[tuple[str, str], object] = {}  # read-only shipped calibrations, loaded once
_SHIPPED_LOCK = threading.Lock()


def _fresh_lock() -> None:
    """In a forked child (a ZeroGPU worker): a lock of its own (``pairs._fresh_locks``)."""
    global _SHIPPED_LOCK
    _SHIPPED_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock)


def calibration_summary(calib) -> str:
    """One line on what a calibration saw and chose: domains, shrinkage, identity codes, patches."""
    st = calib.stats
    domains = st.get("domains") or ["one text"]
    parts = [f"Calibrated on {len(domains)} domain{'s' if len(domains) > 1 else ''}: {', '.join(domains)}."]
    if "shrink" in st:
        parts.append(f"REUSE maps shrunk toward identity by {st['shrink']:g} (chosen on held-out domains); identity "
                     f"code on {len(st.get('identity_k', []))} K and {len(st.get('identity_v', []))} V layers.")
    if st.get("joint_layers"):
        parts.append(f"Joint K+V refinement (rank {st.get('joint_rank', calib.config.joint_rank)}, "
                     f"ridge {st['joint_shrink']:g}, chosen on held-out domains) on {len(st['joint_layers'])} of "
                     f"{calib.n_layers} layers, weighed down for the codes' quantisation noise.")
    gated = [int(k) for k, v in st.get("patch_gate", {}).items() if not v["kept"]] if calib.config.gate_patches else []
    parts.append(f"Patch order {calib.patch_order}"
                 + (f"; gated out (worse than the code off-domain): {gated}." if gated else "."))
    if st.get("patch_gate"):
        parts.append("Aligners: identity + a linear correction shrunk toward identity (chosen on held-out domains).")
    trained = st.get("distil")
    if calib.corrections and trained:
        kl = trained["val_kl"]
        parts.append(f"Correction stage trained through the consumer on {len(calib.corrections)} layers (rank "
                     f"{trained['config']['rank']}, {trained['train_windows']} training windows; validation "
                     f"{kl[0]:.4f} → {kl[trained['best_epoch']]:.4f}); the \"(closed form)\" rows are without it.")
    return " ".join(parts)


def get_calibration(pair: Pair, folder: str | Path | None = None):
    """The pair's SCD calibration: the one in ``folder`` (a visitor's, made or loaded in their session), else the
    shipped one (read once per process, read-only)."""
    from scdviz.scd import calibration

    if folder is not None:
        return calibration.Calibration.load(folder, pair)
    key = (pair.producer_source, pair.consumer_source)
    with _SHIPPED_LOCK:
        if key not in _SHIPPED_CALIBS:
            shipped_folder = calibration.shipped_folder(pair.consumer_source)
            shipped = pair.producer_source == builtin_choices()[0] and pair.consumer_source in builtin_choices()[1]
            if not shipped or not (shipped_folder / calibration.FILE).is_file():
                raise UserError(f"no SCD calibration for {pair.consumer_source} yet; make one in the Calibrate / train "
                                f"tab or with `python -m scdviz calibrate --producer ... --consumer ...` (saved in "
                                f"the runs folder), then load it there")
            _SHIPPED_CALIBS[key] = calibration.Calibration.load(shipped_folder, pair)
        return _SHIPPED_CALIBS[key]


def _parse_layers(text: str, n_layers: int, what: str = "manual patch layers") -> list[int]:
    try:
        layers = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise UserError(f"{what} must be integers separated by commas, got {text!r}") from None
    bad = [x for x in layers if not 0 <= x < n_layers]
    if bad:
        raise UserError(f"{what} must be between 0 and {n_layers - 1}, got {bad}")
    return layers


def scd_run(pair: Pair, request: ScdRequest, calibration: str | Path | None = None, progress=False) -> dict:
    """Every SCD method on one text: what the tab shows (info, table, texts) and what its figures are drawn from
    (``figures``), all picklable and on the host, no figure (a GPU call's result, ``scdviz.app.gpu``).
    ``calibration``: the folder of the visitor's calibration for the pair (None: the shipped one);
    ``progress``: a reporter (``scdviz.progress``) told each method."""
    from scdviz import link
    from scdviz.scd import bench, measure, view
    from scdviz.scd import plan as plans

    req = request.checked()
    text, cont_len, gen_tokens, bits, placement = (req.text, req.continuation_tokens, req.generated_tokens, req.bits,
                                                   req.placement)
    gbps, latency_s, budget, coder = req.bandwidth_gbps, req.latency_ms / 1000, req.byte_budget, req.coder
    calib = get_calibration(pair, calibration)
    full_k = max(c.max_rank for c in calib.key_codes)
    full_v = max(c.max_rank for c in calib.value_codes)
    rank_k = inputs.integer(req.rank_k, "r_K", 0, full_k)  # within this calibration's ranks and layers
    rank_v = inputs.integer(req.rank_v, "r_V", 0, full_v)
    patch_k = inputs.integer(req.patch_layers, "Patch layers k", 0, calib.n_layers)
    ordered = len(calib.patch_order if placement == "selected" else calib.drift_order)
    asked, patch_k = patch_k, min(patch_k, ordered)  # "up to k": a gated calibration may order fewer
    manual = _parse_layers(req.manual_layers, calib.n_layers)
    assert coder in bench.CODERS, coder  # the request offers only the bench's coders
    if budget and calib.rate is None:
        raise UserError("this calibration has no rate-distortion curves (nor the sensitivities) a byte budget needs: "
                        "add them with python -m scdviz rate, or calibrate again; or set the byte budget to 0")
    plan = None if budget else plans.user_plan(calib, patch_k, placement, bits, rank_k or None, rank_v or None, manual)
    extra = {"tails": [req.recompute_tail] if req.recompute_tail else [],
             "qa_answer_len": qa.ANSWER_LEN if req.ask else 0}
    report = view.transfer_view(pair, calib, text, plan, cont_len, gen_tokens, budget=budget or None, coder=coder,
                                progress=progress, extra=extra)
    plan = report.plans["SCD full"]
    full = next(r for r in report.methods if r.method == "SCD full")
    table = report.table()
    own = link.Link(gbps, latency_s)
    table["ttft_your_link_ms"] = [
        round(1000 * (r.oracle_seconds if r.method == "oracle" else
                      link.ttft(r.payload_bytes_per_token * r.prompt_tokens, r.consumer_seconds + r.encode_seconds,
                                own)), 1)
        for r in report.methods + report.sweeps]  # the table's rows: the lineup, then any sweep (the tail's)
    tok = pair.tokenizer
    texts = [(r.method, [tok.decode([t]) for t in (r.generations[0] if r.generations else [])]) for r in report.methods]
    answers = question_answers(pair, report, text, cont_len) if req.ask else None
    res = report.methods
    spectra = measure.spectra(calib)
    if plan.rate_target:  # transform coded: the ranks the payload really carried
        sent_k, sent_v = ([round(c) for c in full.sent[f"cols_{kind}"]] for kind in "kv")
    else:
        sent_k, sent_v = plan.rank_k, plan.rank_v
    kls = {r.method: float(r.kl) for r in res}
    drawn = {"methods": res, "ideal_gain": list(calib.ideal_gain), "patched": plan.layers_in("patch"),
             "spectra": spectra, "sent_k": sent_k, "sent_v": sent_v, "table": table, "latency_s": latency_s,
             "plan": plan, "sent": full.sent if plan.rate_target else None,
             "focus": ["SCD full", plots_best_other(kls)]}
    mine = calibration is not None
    fewer = (f" (asked for {asked}; this calibration orders {ordered} patch layers for this placement)"
             if asked > patch_k and placement != "manual" else "")
    how = (f"SCD full is the transform-coded plan for {budget:g} B/token ({full.payload_bytes_per_token:.0f} sent: "
           f"one uniform step per section, entropy coded; the ranks sent and bits per value in the plan plot)"
           if budget and coder == "transform" else
           f"SCD full is the rate-distortion plan for {budget:g} B/token (ranks and bits per layer in the plan plot; "
           f"patch layers {plan.layers_in('patch') or 'none'})" if budget else
           f"SCD full patches layers {plan.layers_in('patch') or 'none'}{fewer} with {bits}-bit codes")
    info = (f"{int(res[0].prompt_tokens)} prompt tokens, {cont_len} scored. {how}. Consumer {pair.consumer_source}; "
            f"{'your calibration' if mine else 'the shipped calibration'}. {calibration_summary(calib)}")
    return {"info": info, "table": table, "texts": texts, "answers": answers, "figures": drawn}


def question_answers(pair: Pair, report, text: str, cont_len: int) -> dict:
    """What the tab shows of the consumer's question about ``text`` (``view.question_of``, as the bench asked it):
    its kind, the question and the reference answer as text, and per method its answer's tokens as text and its
    token-F1."""
    from scdviz.scd import view

    window = view.window_of(pair, text, cont_len, settings.max_prompt_tokens())
    kind, item = view.question_of(pair, window, cont_len)
    tok = pair.tokenizer
    return {"kind": kind, "question": tok.decode(item.question[1:]),  # the first is the prompt's pending last token
            "reference": [tok.decode([t]) for t in item.answer],
            "methods": [(r.method, [tok.decode([t]) for t in r.qa_answers[0]], r.qa_f1[0])
                        for r in report.methods if r.qa_answers]}


def plots_best_other(kls: dict[str, float]) -> str:
    """The best baseline by KL (neither an SCD method nor the oracle): drawn strong beside SCD full."""
    from scdviz import plots

    return plots.best_other(kls, {m for m in kls if m.startswith("SCD") or m == "oracle"})


def scd_figures(drawn: dict) -> dict:
    """The SCD tab's figures from what ``scd_run`` returned under ``figures`` (built where the page is served,
    never in a GPU call): SCD full and the best baseline strong, the rest faint (a legend click shows each)."""
    from scdviz import plots

    res, latency_s = drawn["methods"], drawn["latency_s"]
    figures = {
        "drift_k": plots.layer_drift(res[1:], "K"), "drift_v": plots.layer_drift(res[1:], "V"),
        "accumulation": plots.error_accumulation(res), "amplification": plots.amplification(res[1:]),
        "placement": plots.patch_placement(drawn["ideal_gain"], drawn["patched"]),
        "spectra_k": plots.rank_spectra(drawn["spectra"], "K", drawn["sent_k"]),
        "spectra_v": plots.rank_spectra(drawn["spectra"], "V", drawn["sent_v"]),
        "pareto": plots.pareto(drawn["table"]), "compute": plots.compute_axis(drawn["table"]),
        "ttft": plots.ttft_vs_bandwidth(res, latency_s=latency_s),
        "plan": plots.plan_layers(drawn["plan"], drawn["sent"]),
    }
    for fig in figures.values():
        plots.paint(fig, set(drawn["focus"]))
    return figures

"""PATCH as an aligned span (issue 31, part 2): the consumer runs a block of its own layers itself, fed a
code of the residual stream entering it that is decoded into the consumer's own residual space.

DroidSpeak-style recompute feeds a span the producer's residual as it is, so the producer's drift enters
the consumer's own layers and travels through them. An aligned span sends instead a span code of that
residual: a reduced-rank regression (scdviz.scd.rrr) from the producer's residual entering layer
``start`` to the consumer's own there, fitted on the calibration's own fit windows (calib splits; token
0, the attention sink, left out: the consumer uses its own), shrunk toward the identity with the
shrinkage chosen per start by leave-one-domain-out error, and each column weighed by the weight of the
span's first input RMSNorm (what that layer reads of it). Unweighted, a residual's few massive columns
set the scale of the ridge and the shrinkage (relative to the mean eigenvalue), and on the built-in pair
every shrinkage tried from layer 26 held out worse than the producer's residual itself (0.95 to 1.22
against 0.93). Per start, that fit, the identity code (the producer's residual, means matched) or the
producer's residual itself (its own mean) is kept, whichever gives the span plan the lower KL on the
calibration's selection windows. The consumer
decodes the code and runs layers ``start``.. itself (scdviz.scd.plan.span_plan); a trained correction of
the decoded residual (scdviz.scd.distil, key ``calibration.span_key(start)``) is the aligner trained
through the consumer.

``fit(pair, calib, cfg)`` returns the calibration with its span codes (a new tag: its payloads never mix
with the calibration's without them) and the fit's numbers (also in ``stats["spans"]``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from scdviz import metrics
from scdviz.config import opt
from scdviz.models import hf
from scdviz.models.pair import Pair
from scdviz.progress import Reporter, steps
from scdviz.scd import calibrate, transfer
from scdviz.scd import plan as plans
from scdviz.scd.calibration import Calibration, windows
from scdviz.scd.rrr import RRRStats


@dataclass
class SpanConfig:
    """One fit of span codes."""

    starts: list[int] = opt([8, 15, 23, 26], "layers a span may start at (it runs to the last layer): one span "
                            "code each; on the built-in 30-layer pair these spans are 73, 50, 23 and 13 percent of "
                            "the consumer's prefill")
    shrink_grid: list[float] = opt([0.0, 0.03, 0.1, 0.3, 1.0], "candidate shrinkages toward the identity, "
                                   "chosen per start by leave-one-domain-out error")
    select: bool = opt(True, "then keep, per start, that fit, the identity code (the producer's residual, means "
                       "matched) or the producer's residual itself (its own mean), whichever gives the lower KL of "
                       "the span plan on the calibration's selection windows (squared error of the residual and the "
                       "consumer's KL disagree on the built-in pair)")

    def __post_init__(self) -> None:
        if not self.starts:
            raise ValueError("--starts needs at least one layer")
        if any(a < 0 for a in self.shrink_grid) or not self.shrink_grid:
            raise ValueError(f"--shrink-grid needs shrinkages of 0 or more, got {self.shrink_grid}")


def fit(pair: Pair, calib: Calibration, cfg: SpanConfig, progress: bool | Reporter = True) -> tuple[Calibration, dict]:
    """The span codes of ``cfg.starts`` fitted on the calibration's fit windows; see the module docstring."""
    n = calib.n_layers
    bad = [s for s in cfg.starts if not 0 < s < n]
    if bad:
        raise ValueError(f"span starts must be layers 1..{n - 1} of this pair (a span from layer 0 is the consumer's "
                         f"whole prefill); got {bad}")
    t0 = time.perf_counter()
    starts = sorted(set(cfg.starts))
    fit_windows, folds, select_windows = windows(pair, calib.config)
    d = pair.consumer_facts.hidden
    stats = [{s: RRRStats(d, d) for s in starts} for _ in range(max(folds) + 1)]  # fold -> start -> statistics
    for window, fold in steps(list(zip(fit_windows, folds)), "span: paired prefills (residual streams)", progress):
        prefix = hf.ids_tensor(window[: calib.config.prompt_len - 1])
        p, c = (hf.forward(model, prefix, capture={"resid"}, last_logits=True).resid
                for model in (pair.producer, pair.consumer))
        for s in starts:
            stats[fold][s].add(p[s][0, 1:].float().cpu(), c[s][0, 1:].float().cpu())  # statistics live on the host
    ridge, codes = calib.config.ridge, {}
    out = {"starts": starts, "windows": len(fit_windows), "selection_windows": len(select_windows) if cfg.select else 0,
           "by_start": {}}
    if cfg.select:  # the consumer's own continuations of the selection windows, prepared once
        select_cases = [transfer.prepare_case(pair.producer, pair.consumer, w, calib.config.cont_len)
                        for w in steps(select_windows, "span: selection windows", progress)]
    for s in starts:
        # columns weighed as the span's first layer reads them: its input RMSNorm's weight
        sigma = 1 / hf.input_norm_weight(pair.consumer, s).double().cpu().abs().clamp_min(1e-3)
        scaled = [{s: f[s].scaled(sigma)} for f in stats]
        pooled = calibrate.summed(scaled, s)
        errors = {a: calibrate.lodo_error(scaled, s, ridge, a) for a in cfg.shrink_grid}
        alpha = min(errors, key=errors.get)
        codes[s] = pooled.fit(ridge, shrink=alpha).rescaled(sigma)
        raw = calibrate.lodo_error(scaled, s, ridge, float("inf"))  # B = I: the producer's residual, means matched
        out["by_start"][str(s)] = {"shrink": alpha, "lodo_error": {str(a): round(e, 5) for a, e in errors.items()},
                                   "lodo_error_identity": round(raw, 5),
                                   "fit_err": round(float(codes[s].fit_err[-1]), 5)}
        if cfg.select:
            identity = pooled.fit(ridge, shrink=float("inf")).rescaled(sigma)
            # the producer's residual itself, its own mean kept (on austen-qkv matching the consumer's mean
            # from the calibration text cost KL from layer 15: 0.0899 against 0.0675 on 16 dev prompts)
            own = replace(identity, mu_out=identity.mu_in.clone())
            by = {"fit": codes[s], "identity": identity, "producer": own}
            kl = {name: selection_kl(pair, calib, s, code, select_cases, progress) for name, code in by.items()}
            chosen = min(kl, key=kl.get)
            codes[s] = by[chosen]
            out["by_start"][str(s)] |= {"selection_kl": {k: round(v, 5) for k, v in kl.items()}, "chosen": chosen}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return replace(calib, spans={**(calib.spans or {}), **codes}, stats={**calib.stats, "spans": out}), out


def selection_kl(pair: Pair, calib: Calibration, start: int, code, cases, progress) -> float:
    """Mean continuation KL of the span from ``start`` fed ``code`` over the prepared selection ``cases``."""
    trial = replace(calib, spans={**(calib.spans or {}), start: code}, corrections=None)
    plan = plans.span_plan(trial, start)
    kls = [float(metrics.kl_per_token(c.oracle_logits, transfer.run_plan(pair.consumer, c, plan, trial).logits).mean())
           for c in steps(cases, f"span: selection KL from layer {start}", progress)]
    return sum(kls) / len(kls)

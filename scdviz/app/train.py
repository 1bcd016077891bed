"""The Calibrate / train tab's work: SCD calibration, its trained correction stage, checking a saved one,
fitting the distilled scorer (the headline eviction method), DistillCache training (REINFORCE: docs/design.md#training).

Each function is the work of one GPU call (``scdviz.app.gpu``): it writes its artefact into ``folder`` (a run
of the visitor's session, made by the server's process) and returns a picklable summary of it; the server's
process then makes the artefact the visitor's (``Session.calibrations`` / ``Session.policies`` hold paths,
never a loaded model part), so nothing a visitor makes lives in a global or only in a worker process.
``load_artefact`` reads a visitor's policy or scorer back where it is used.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from scdviz.app.requests import CalibrateRequest, DistilRequest, FitRequest, TrainRequest
from scdviz.models.pair import Pair
from scdviz.progress import Reporter


def calibration_shown(calib) -> dict:
    """What the tab shows of a calibration (picklable): its summary line, seconds, selection curve, patch order."""
    from scdviz.app import scd

    return {"summary": scd.calibration_summary(calib), "seconds": calib.stats.get("seconds_total", "?"),
            "selection_kl": list(calib.selection_kl), "patch_order": list(calib.patch_order)}


def calibrate_for(pair: Pair, request: CalibrateRequest, folder: Path, progress: bool | Reporter = True) -> dict:
    """Calibrate SCD for a loaded pair on a mixture of shipped corpora and save it in ``folder``; returns
    ``calibration_shown``. ``progress``: a reporter (``scdviz.progress``) that may stop the work."""
    from scdviz.scd import calibrate as cal
    from scdviz.scd import calibration

    req = request.checked()
    cfg = calibration.CalibConfig(domains=req.domains, n_fit=req.fit_windows, n_select=req.select_windows,
                                  rate_windows=req.rate_windows, n_candidates=8,
                                  op_patch_k=req.patch_layers, code_bits=req.bits, patch_k=max(req.patch_layers, 2))
    calib = cal.calibrate(cfg, pair, progress=progress)
    calib.save(folder)
    return calibration_shown(calib)


def distil_for(pair: Pair, request: DistilRequest, folder: Path, base_folder: str | Path | None = None,
               progress: bool | Reporter = True, work: str | Path | None = None) -> dict:
    """Train the correction stage of the SCD tab's calibration for this visitor (the one in ``base_folder``, else
    the shipped one) through the consumer (``scdviz.scd.distil``) and save the result in ``folder``; returns
    the training log. Without rate curves (a calibration made here) it trains at the operating point only, and
    the log says so. ``work``: the fit's prepared windows and checkpoint (``distil.distil``'s folder), where a
    stopped fit asked for again resumes; removed once the fit is saved."""
    from scdviz.app import scd
    from scdviz.scd import distil

    req = request.checked()
    base = scd.get_calibration(pair, base_folder)  # says what to do when the pair has none
    cfg = distil.DistilConfig(rank=req.rank, epochs=req.epochs, train_windows=req.train_windows,
                              val_windows=req.val_windows, recall=req.recall,
                              recall_target=req.recall_target, val_every=req.val_every)  # budgets: the CLI's
    if not (req.budgets and base.rate is not None):
        cfg.budgets = []  # the operating point only
    calib, log = distil.distil(pair, base, cfg, progress=progress, folder=work)
    log["asked_budgets_without_rate"] = bool(req.budgets and base.rate is None)
    calib.save(folder)
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
    return log


def check_calibration(pair: Pair, folder: str | Path) -> dict:
    """Read a saved calibration folder for the pair (ValueError for another pair's or a damaged one); returns
    ``calibration_shown``. Which folders a visitor may name is the caller's check (``hosting.user_folder``)."""
    from scdviz.scd import calibration

    return calibration_shown(calibration.Calibration.load(folder, pair))


def hosted_fit(pair: Pair) -> None:
    """Hosted mode keeps every request within about a minute; fitting the distilled scorer takes minutes on a CPU
    even at the smallest sizes (6 + 6 contexts: the prefills, teacher passes and greedy decodes of 512-token
    contexts, then 12 candidates validated; ``python -m research.hosted_load --heavy``), so a hosted demo whose pair
    sits on a CPU refuses it before any work (UserError naming where it runs); nothing outside hosted mode."""
    from scdviz import settings
    from scdviz.app.inputs import UserError
    from scdviz.models import hf

    if settings.hosted() and hf.device_of(pair.producer).type == "cpu":
        raise UserError("this hosted demo runs on a CPU, where fitting the distilled scorer takes minutes even at the "
                        "smallest sizes; it fits on a GPU host, or run it in a local install (python -m scdviz "
                        "fit-student, or this tab there)")


def fit_scorer(pair: Pair, request: FitRequest, folder: Path, progress: bool | Reporter = True,
               work: str | Path | None = None) -> dict:
    """Fit the distilled scorer (``scdviz.fit_student``: closed form on the future's attention, ridge and decode weight
    chosen on validation, then the listwise stage) on the pair's producer and save it in ``folder``; returns its
    fit log, with ``kept`` the kept candidate's meta. The shipped recipe's settings but the sizes a live session
    can afford: the request's contexts, 2 validation contexts decoding 64 tokens. ``work``: the fit's checkpoint
    and listwise spool (``student_fit.fit``'s folder), where a stopped fit asked for again resumes; removed once
    the scorer is saved."""
    from scdviz.evict.student import StudentConfig
    from scdviz.evict.student_fit import FitConfig, fit

    req = request.checked()
    cfg = FitConfig(out=str(folder), contexts=req.contexts, val_contexts=req.val_contexts, val_decode=2,
                    val_decode_tokens=64, student=StudentConfig(window=req.window))
    student = fit(cfg, pair, progress=progress, folder=work)
    student.save(folder)
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
    return {**student.log, "kept": dict(student.meta)}


def train_policy(pair: Pair, request: TrainRequest, folder: Path, progress: bool | Reporter = True,
                 on_log=None) -> dict:
    """Train a DistillCache policy (REINFORCE: docs/design.md#training) on the pair's producer into ``folder``;
    ``on_log(log)`` after every step and checkpoint (a live plot). Returns the final log. ``progress``: a
    reporter (``scdviz.progress``) that may stop the work."""
    from scdviz.evict.policy import PolicyConfig
    from scdviz.evict.train import TrainConfig, checkpoints_to, train

    req = request.checked()
    # the CLI's defaults except the sizes a live session can afford (learning rate, entropy: as the CLI)
    cfg = TrainConfig(out=str(folder), contexts=req.contexts, steps=req.steps, warm_steps=50,
                      checkpoint_every=max(5, req.steps // 4), val_contexts=4,
                      policy=PolicyConfig(per_head=req.per_head))
    then = (lambda event: on_log(event.log)) if on_log is not None else None
    return train(cfg, pair, checkpoints_to(folder, then=then), progress=progress).log


def load_artefact(path: str | Path):
    """A visitor's eviction method saved in a run folder (``path``: its ``best.safetensors``): a distilled scorer
    (``Student``) or a DistillCache ``Policy``, by the kind its header names, on the host."""
    from scdviz import artefact
    from scdviz.evict.policy import Policy
    from scdviz.evict.student import KIND, Student

    return Student.load(path) if artefact.kind_of(path) == KIND else Policy.load(path)

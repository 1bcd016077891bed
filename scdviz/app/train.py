"""The Calibrate / train tab's work: SCD calibration, its trained correction stage, loading a saved one,
fitting the distilled scorer (the headline eviction method), DistillCache training (REINFORCE: docs/design.md#training).

What a visitor makes or loads goes into their ``Session`` (and a run folder), never a global.
"""

from __future__ import annotations

from pathlib import Path

from scdviz.app import hosting
from scdviz.app.requests import CalibrateRequest, DistilRequest, FitRequest, TrainRequest
from scdviz.app.session import Session
from scdviz.models.pair import Pair
from scdviz.progress import Reporter


def calibrate_for(pair: Pair, session: Session, request: CalibrateRequest, folder: Path,
                  progress: bool | Reporter = True) -> object:
    """Calibrate SCD for a loaded pair on a mixture of shipped corpora, save it in ``folder`` (a run of
    ``session``), and make it this session's calibration for the pair (no one else's changes).
    ``progress``: a reporter (``scdviz.progress``) that may stop the work."""
    from scdviz.scd import calibrate as cal
    from scdviz.scd import calibration

    req = request.checked()
    cfg = calibration.CalibConfig(domains=req.domains, n_fit=req.fit_windows, n_select=4, n_candidates=8,
                                  op_patch_k=req.patch_layers, code_bits=req.bits, patch_k=max(req.patch_layers, 2))
    calib = cal.calibrate(cfg, pair, progress=progress)
    calib.save(folder)
    session.calibrations[(pair.producer_source, pair.consumer_source)] = calib
    return calib


def distil_for(pair: Pair, session: Session, request: DistilRequest, folder: Path,
               progress: bool | Reporter = True) -> tuple[object, dict]:
    """Train the correction stage of the SCD tab's calibration for this visitor (theirs, else the shipped
    one) through the consumer (``scdviz.scd.distil``), save the result in ``folder`` (a run of ``session``)
    and make it this session's calibration for the pair; returns (it, the training log). Without rate
    curves (a calibration made here) it trains at the operating point only, and the log says so."""
    from scdviz.app import scd
    from scdviz.scd import distil

    req = request.checked()
    base = scd.get_calibration(pair, session)  # says what to do when the pair has none
    cfg = distil.DistilConfig(rank=req.rank, epochs=req.epochs, train_windows=req.train_windows,
                              val_windows=req.val_windows, recall=req.recall,
                              recall_target=req.recall_target)  # budgets: the CLI's (1/6 and 1/10 of fp16)
    if not (req.budgets and base.rate is not None):
        cfg.budgets = []  # the operating point only
    calib, log = distil.distil(pair, base, cfg, progress=progress)
    log["asked_budgets_without_rate"] = bool(req.budgets and base.rate is None)
    calib.save(folder)
    session.calibrations[(pair.producer_source, pair.consumer_source)] = calib
    return calib, log


def load_calibration_for(pair: Pair, session: Session, folder) -> object:
    """Load a saved calibration folder for the pair into this session (refused for another pair).

    In hosted mode only this session's own run folders can be named.
    """
    from scdviz.scd import calibration

    path = hosting.user_folder(folder, "calibration folder", roots=(session.folder,))
    calib = calibration.Calibration.load(path, pair)
    session.calibrations[(pair.producer_source, pair.consumer_source)] = calib
    return calib


def fit_scorer(pair: Pair, session: Session, request: FitRequest, folder: Path,
               progress: bool | Reporter = True) -> dict:
    """Fit the distilled scorer (``scdviz.fit_student``: closed form on the future's attention, ridge and decode weight
    chosen on validation, then the listwise stage) on the pair's producer, save it in ``folder`` (a run of
    ``session``) and add it to this session's eviction methods; returns its fit log. The shipped recipe's settings
    but the sizes a live session can afford: the request's contexts, 2 validation contexts decoding 64 tokens."""
    from scdviz.evict.student import Student, StudentConfig
    from scdviz.evict.student_fit import FitConfig, fit

    req = request.checked()
    cfg = FitConfig(out=str(folder), contexts=req.contexts, val_contexts=req.val_contexts, val_decode=2,
                    val_decode_tokens=64, student=StudentConfig(window=req.window))
    student = fit(cfg, pair, progress=progress)
    student.save(folder)
    session.policies[f"yours:{folder.name}"] = Student.load(folder)
    return student.log


def train_policy(pair: Pair, session: Session, request: TrainRequest, folder: Path, progress: bool | Reporter = True,
                 on_log=None) -> dict:
    """Train a DistillCache policy (REINFORCE: docs/design.md#training) on the pair's producer into ``folder`` (a run of
    ``session``); ``on_log(log)`` after every step and checkpoint (a live plot). The best policy joins this
    session's eviction methods; returns the final log. ``progress``: a reporter (``scdviz.progress``) that may
    stop the work."""
    from scdviz.evict.policy import Policy, PolicyConfig
    from scdviz.evict.train import TrainConfig, checkpoints_to, train

    req = request.checked()
    # the CLI's defaults except the sizes a live session can afford (learning rate, entropy: as the CLI)
    cfg = TrainConfig(out=str(folder), contexts=req.contexts, steps=req.steps, warm_steps=50,
                      checkpoint_every=max(5, req.steps // 4), val_contexts=4,
                      policy=PolicyConfig(per_head=req.per_head))
    then = (lambda event: on_log(event.log)) if on_log is not None else None
    log = train(cfg, pair, checkpoints_to(folder, then=then), progress=progress).log
    session.policies[f"yours:{folder.name}"] = Policy.load(folder / "best.safetensors")
    return log

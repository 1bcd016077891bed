"""The Calibrate / train tab's work: SCD calibration, loading a saved one, DistillCache training.

What a visitor makes or loads goes into their ``Session`` (and a run folder), never a global.
"""

from __future__ import annotations

import threading
from pathlib import Path

from scdviz.app import hosting
from scdviz.app.requests import CalibrateRequest, TrainRequest
from scdviz.app.session import Session
from scdviz.models.pair import Pair


def calibrate_for(pair: Pair, session: Session, request: CalibrateRequest) -> tuple[object, Path]:
    """Calibrate SCD for a loaded pair on a mixture of shipped corpora, save it in a new run
    folder, and make it this session's calibration for the pair (no one else's changes)."""
    from scdviz.scd import calibrate as cal
    from scdviz.scd import calibration

    req = request.checked()
    domains, n_fit, op_k, bits, name = req.domains, req.fit_windows, req.patch_layers, req.bits, req.name
    folder = session.new_run(name, "calibrations")
    cfg = calibration.CalibConfig(domains=domains, n_fit=n_fit, n_select=4, n_candidates=8, op_patch_k=op_k,
                                  code_bits=bits, patch_k=max(op_k, 2))
    calib = cal.calibrate(cfg, pair)
    calib.save(folder)
    session.calibrations[(pair.producer_source, pair.consumer_source)] = calib
    return calib, folder


def load_calibration_for(pair: Pair, session: Session, folder) -> object:
    """Load a saved calibration folder for the pair into this session (refused for another pair).

    In hosted mode only this session's own run folders can be named.
    """
    from scdviz.scd import calibration

    path = hosting.user_folder(folder, "calibration folder", roots=(session.folder,))
    calib = calibration.Calibration.load(path, pair)
    session.calibrations[(pair.producer_source, pair.consumer_source)] = calib
    return calib


def train_policy_live(pair: Pair, session: Session, request: TrainRequest):
    """Train a DistillCache policy on the pair's producer in a thread; yields the growing log
    every ~2 s, then (folder, final log). The best policy joins this session's eviction methods."""
    from scdviz.evict.policy import Policy, PolicyConfig
    from scdviz.evict.train import TrainConfig, checkpoints_to, train

    req = request.checked()
    steps, contexts, per_head, name = req.steps, req.contexts, req.per_head, req.name
    folder = session.new_run(name, "policies")
    # the CLI's defaults except the sizes a live session can afford (learning rate, entropy: as the CLI)
    cfg = TrainConfig(out=str(folder), contexts=contexts, steps=steps, warm_steps=50,
                      checkpoint_every=max(5, steps // 4), val_contexts=4, policy=PolicyConfig(per_head=per_head))
    state: dict = {"log": None, "error": None}

    def work():
        try:
            state["log"] = train(cfg, pair, checkpoints_to(folder, then=lambda event: state.update(log=event.log))).log
        except Exception as err:  # noqa: BLE001 - reported to the caller below
            state["error"] = err

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(2.0)
        yield state["log"]
    if state["error"] is not None:
        raise state["error"]
    session.policies[f"yours:{folder.name}"] = Policy.load(folder / "best.safetensors")
    yield folder, state["log"]

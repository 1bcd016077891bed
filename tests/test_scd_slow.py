"""Slow tier: SCD on the built-in pair (SmolLM2-135M producer, jargon specialist)."""

from __future__ import annotations

import pytest

from scdviz import data
from scdviz.models.pair import PairError
from scdviz.scd import calibrate as cal
from scdviz.scd import calibration, measure
from scdviz.scd import plan as plans

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_calib(builtin_pair):
    cfg = calibration.CalibConfig(domains=["jargon", "bible"], n_fit=8, n_select=2, aligner_steps=30, n_candidates=2,
                                  patch_k=1, op_patch_k=1)
    return cal.calibrate(cfg, builtin_pair, progress=False)


def test_full_rank_codes_with_own_sink_beat_raw_reuse_on_held_out_text(builtin_pair, quick_calib):
    windows = data.token_windows(builtin_pair.tokenizer, data.load_split("jargon", "eval"), 256 + 16, 3)
    cases = measure.prepare_cases(builtin_pair, windows, 16, progress=False)
    rank_k, rank_v = plans.full_ranks(quick_calib)
    lineup = [plans.raw_plan(30), plans.raw_plan(30, bits=4), plans.scd_plan(rank_k, rank_v, code_bits=8)]
    raw, four, scd = measure.run_methods(builtin_pair, quick_calib, cases, lineup, progress=False)
    assert four.payload_bytes_per_token < raw.payload_bytes_per_token / 3
    assert scd.payload_bytes_per_token < raw.payload_bytes_per_token / 1.8
    assert scd.kl < 0.8 * raw.kl  # the map + own token 0 roughly halve raw reuse's KL (docs/results.md)
    assert all(d >= 0 for d in raw.divergence) and raw.divergence[-1] > raw.divergence[1]


def test_shipped_calibrations_belong_to_their_specialist(builtin_pair):
    jargon = calibration.Calibration.load(calibration.SHIPPED_DIR / "jargon", builtin_pair)
    assert len(jargon.key_codes) == 30 and len(jargon.stats["domains"]) == 6
    kept = {int(layer) for layer, gate in jargon.stats["patch_gate"].items() if gate["kept"]}
    assert jargon.stats["patch_gate"] and set(jargon.patch_order) <= kept  # only patches that passed the gate
    for name in ("jargon", "austen-qkv"):  # the budget planner's curves ship with every calibration
        curves = calibration.Calibration.load(calibration.SHIPPED_DIR / name).rate
        assert curves is not None and curves.n_windows >= 6 and (curves.sens_k > 0).all() and (curves.sens_v > 0).all()
        # fp16 codes: error falls as rank rises (on text it was not fitted on)
        full = curves.err_k[:, curves.bits.index(16)]
        assert (full[:, -1] < full[:, 0]).all() and (full[:, 96] <= full[:, 8] + 1e-3).all()
    with pytest.raises(PairError, match="builtin:austen-qkv"):
        calibration.Calibration.load(calibration.SHIPPED_DIR / "austen-qkv", builtin_pair)

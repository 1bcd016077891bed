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
    cfg = calibration.CalibConfig(domains=["jargon", "bible"], n_fit=8, n_select=2, n_candidates=2,
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
    for name in ("jargon", "austen-before"):  # the budget planner's curves ship with every calibration
        curves = calibration.Calibration.load(calibration.SHIPPED_DIR / name).rate
        assert curves is not None and curves.n_windows >= 6 and (curves.sens_k > 0).all() and (curves.sens_v > 0).all()
        # fp16 codes: error falls as rank rises (on text it was not fitted on)
        full = curves.err_k[:, curves.bits.index(16)]
        assert (full[:, -1] < full[:, 0]).all() and (full[:, 96] <= full[:, 8] + 1e-3).all()
    with pytest.raises(PairError, match="builtin:austen-before"):
        calibration.Calibration.load(calibration.SHIPPED_DIR / "austen-before", builtin_pair)


def test_a_recomputed_tail_lowers_every_methods_kl_on_the_builtin_pair(builtin_pair):
    """The consumer recomputing the last 32 prompt tokens itself (``Plan.tail``): on dev-slice jargon
    windows both raw reuse and SCD reuse-only (shipped calibration) fall in KL on every window, the bytes fall
    by about the tail's share and the compute share is the tail's share of the prefix."""
    calib = calibration.Calibration.load(calibration.SHIPPED_DIR / "jargon", builtin_pair)
    windows = [w.ids for w in data.eval_windows(builtin_pair.tokenizer, "jargon", "dev", 256 + 32, 2)]
    cases = measure.prepare_cases(builtin_pair, windows, 32, progress=False)
    reuse = plans.operating_plan(calib, patch_k=0)
    lineup = [plans.raw_plan(30), reuse, plans.with_tail(plans.raw_plan(30), 32), plans.with_tail(reuse, 32)]
    raw, scd, raw_t, scd_t = measure.run_methods(builtin_pair, calib, cases, lineup, progress=False)
    for base, tailed in ((raw, raw_t), (scd, scd_t)):
        assert all(t < b for t, b in zip(tailed.kl_per_prompt, base.kl_per_prompt, strict=True))
        kept = (255 - 32) / 255  # the tail's rows are not sent
        assert tailed.payload_bytes_per_token == pytest.approx(base.payload_bytes_per_token * kept, rel=0.03)
        assert tailed.prefill_share == pytest.approx(32 / 255) and base.prefill_share == 0.0
    assert scd_t.kl < scd.kl < raw.kl

"""Fast tier: PATCH as an aligned span (scdviz.scd.span) on tiny random models: the span code, its wire
section, the consumer running its own layers from it, its aligner trained through them, and the bench's
compute axis."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import tiny_model
from test_scd import make_pair, small_cfg

from scdviz import metrics
from scdviz.models import hf
from scdviz.scd import calibrate as cal
from scdviz.scd import calibration, payload, rrr, span, transfer
from scdviz.scd import plan as plans


@pytest.fixture(scope="module")
def spanned(tiny_pair, texts):
    """The tiny pair's calibration with span codes from layers 1 and 2 (of 3)."""
    calib = cal.calibrate(small_cfg(texts), tiny_pair, progress=False)
    return span.fit(tiny_pair, calib, span.SpanConfig(starts=[1, 2]), progress=False)[0]


def _window(n: int = 48, seed: int = 3) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_scaled_statistics_fit_the_same_map_on_columns_of_any_scale():
    """Fitting (x / sigma, y / sigma) and rescaling the code is a code of (x, y): on rows whose columns
    differ in scale by 10^4 it predicts y as the direct full-rank least squares does, where the unscaled
    fit, whose ridge takes its scale from the huge columns, loses most of the small ones."""
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-2, 2, 10, dtype=torch.float64)
    x = torch.randn(600, 10, generator=g, dtype=torch.float64) * scale
    y = (x / scale @ torch.randn(10, 10, generator=g, dtype=torch.float64)) * scale
    st = rrr.RRRStats(10, 10)
    st.add(x, y)
    sigma = x.std(0)
    code = st.scaled(sigma).fit(1e-9).rescaled(sigma)
    exact = torch.linalg.lstsq(torch.cat([x, torch.ones(600, 1, dtype=x.dtype)], 1), y).solution
    direct = torch.cat([x, torch.ones(600, 1, dtype=x.dtype)], 1) @ exact
    got = code.decode(code.encode(x.float(), 10)).double()
    rel = ((got - direct) ** 2).sum(0) / ((y - y.mean(0)) ** 2).sum(0)
    assert float(rel.max()) < 1e-4
    plain = st.fit(1e-3)
    rel_plain = ((plain.decode(plain.encode(x.float(), 10)).double() - direct) ** 2).sum(0) / (
        (y - y.mean(0)) ** 2).sum(0)
    assert float(rel_plain[0]) > 0.5  # the smallest column is all but lost without the scaling


def test_between_identical_models_an_aligned_span_gives_the_consumer_its_own_cache(texts):
    """Producer = consumer: the span code maps the residual to itself, so the layers the consumer runs from
    it hold its own K, V (fp16 codes, full rank), and the continuation's KL is ~0. The payload carries one
    r_code section at the span's start and no fp16 residual; the header names the calibration."""
    model = tiny_model("llama")
    pair = make_pair(model, model)
    calib = cal.calibrate(small_cfg(texts), pair, progress=False)
    calib, info = span.fit(pair, calib, span.SpanConfig(starts=[1]), progress=False)
    assert info["by_start"]["1"]["lodo_error"][str(info["by_start"]["1"]["shrink"])] < 1e-3
    plan = plans.span_plan(calib, 1)
    plan = dataclasses.replace(plan, code_bits=16)
    assert plan.modes == ["code", "recompute", "recompute"] and plan.resid_code
    window = _window()
    case = transfer.prepare_case(pair.producer, pair.consumer, window, 8)
    blob = transfer.build_payload(case.state, plan, calib)
    kinds = [(s.layer, s.kind) for s in payload.spans(blob)[1]]
    assert (1, "r_code") in kinds and not any(k == "resid" for _, k in kinds)
    assert payload.decode(blob).layout.calibration == calib.tag
    got = hf.cache_kv(transfer.receive(pair.consumer, blob, calib).cache)
    own = hf.cache_kv(case.oracle_cache)
    for layer in (1, 2):
        for a, b in ((got[0][layer], own[0][layer]), (got[1][layer], own[1][layer])):
            assert float((a - b).norm() / b.norm()) < 1e-2
    run = transfer.run_plan(pair.consumer, case, plan, calib)
    assert float(metrics.kl_per_token(case.oracle_logits, run.logits).mean()) < 1e-3


def test_span_codes_survive_save_and_load_and_name_another_calibration(tiny_pair, spanned, tmp_path):
    """Span codes are written with the calibration and read back (fp16 matrices); the calibration with
    them has another tag than without, and a payload of one is refused by the other."""
    spanned.save(tmp_path)
    back = calibration.Calibration.load(tmp_path)
    assert sorted(back.spans) == [1, 2] and back.tag == spanned.tag
    base = copy.copy(spanned)
    base.spans, base.stats = None, {k: v for k, v in spanned.stats.items() if k != "spans"}
    base.__dict__.pop("tag", None)
    assert base.tag != spanned.tag
    for name in ("mu_in", "mu_out", "enc", "dec"):
        torch.testing.assert_close(getattr(back.spans[2], name), getattr(spanned.spans[2], name), rtol=2e-3, atol=1e-3)
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, _window(), 8)
    blob = transfer.build_payload(case.state, plans.span_plan(spanned, 2), spanned)
    with pytest.raises(ValueError, match="use the sender's calibration"):
        transfer.receive(tiny_pair.consumer, blob, base)
    with pytest.raises(ValueError, match="no span code for a span starting at layer 1"):
        plans.span_plan(base, 1)


def test_a_span_fed_the_producer_residual_is_droidspeak_and_sends_it_in_fp16(tiny_pair, spanned):
    """The unaligned twin sends the producer's residual as it is (d columns, fp16, token 0 included) and
    runs the same layers: what it gives the consumer is exactly hf.run_layers on the producer's residual."""
    plan = plans.span_plan(spanned, 2, aligned=False)
    assert not plan.resid_code and plan.name == "SCD span 2-2 (producer residual)"
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, _window(), 8)
    blob = transfer.build_payload(case.state, plan, spanned)
    (sec,) = [s for s in payload.spans(blob)[1] if s.kind == "resid"]
    assert sec.layer == 2 and sec.bits == 16 and sec.cols == 32 and sec.rows == case.state.ids.shape[1]
    got = hf.cache_kv(transfer.receive(tiny_pair.consumer, blob, spanned).cache)
    n = case.state.ids.shape[1]
    sent = case.state.resid[2].half().float().unsqueeze(0)  # as the payload carries it
    _, ks, _ = hf.run_layers(tiny_pair.consumer, sent, torch.arange(n)[None], 2, 3)
    assert torch.equal(got[0][2][:, :, 1:], ks[0][:, :, 1:])  # token 0: the consumer's own (sink recomputed)


def test_prefill_share_counts_the_layers_the_consumer_runs_itself(spanned):
    assert plans.prefill_share(["code", "recompute", "recompute"]) == pytest.approx(2 / 3)
    assert plans.prefill_share(["own"] * 4) == 1.0 and plans.prefill_share(["raw", "patch", "code"]) == 0.0
    assert [p.name for p in plans.span_sweep(spanned)] == [  # from the first start to each later one, then to the end
        "SCD span 1-1 (aligned)", "SCD span 1-1 (producer residual)", "SCD span 1-2 (aligned)",
        "SCD span 1-2 (producer residual)", "SCD span 2-2 (aligned)", "SCD span 2-2 (producer residual)"]
    assert plans.span_sweep(spanned)[0].modes == ["code", "recompute", "code"]
    with pytest.raises(ValueError, match="0 < start < stop"):
        plans.span_plan(spanned, 0)
    with pytest.raises(ValueError, match="span starts must be layers 1..2"):
        span.fit(None, spanned, span.SpanConfig(starts=[3]))


def test_distilling_a_span_trains_its_aligner_through_the_consumer_layers(tiny_pair, spanned):
    """With ``spans``, distil trains at each aligned span plan too. Trained at a span whose code is cut to
    rank 4 of 32 (room to learn): the kept corrections include the span's aligner (key span_key(start)),
    which moved off the identity, validation KL fell below the closed form's, the kept corrections give
    the logged KL again, and no gradient landed on the consumer."""
    from scdviz.scd import distil

    cfg = distil.DistilConfig(rank=4, epochs=4, train_windows=4, val_windows=2, prompt_len=40, cont_len=8, lr=1e-2,
                              budgets=[], spans=True)
    assert [p.name for p in distil.trained_plans(spanned, cfg)][1:] == ["SCD span 1-2 (aligned)",
                                                                         "SCD span 2-2 (aligned)"]
    with pytest.raises(ValueError, match="fit them with `python -m scdviz span` first"):
        distil.trained_plans(_without_spans(spanned), cfg)
    plan = plans.span_plan(spanned, 1, rank=4, name="span 1-2 at rank 4")
    out, log = distil.distil(tiny_pair, spanned, cfg, progress=False, at=[plan])
    best = log["best_epoch"]
    assert best > 0 and log["val_kl"][best] < 0.9 * log["val_kl"][0]
    assert calibration.span_key(1) in out.corrections
    assert float(out.corrections[calibration.span_key(1)]["b"].abs().max()) > 0
    _, val_w = distil.windows(tiny_pair, spanned, cfg)
    cases = [transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, w, cfg.cont_len) for w in val_w]
    with torch.no_grad():
        blobs = [transfer.build_payload(c.state, plan, out) for c in cases]
        kl = sum(float(distil.continuation_kl(tiny_pair, distil.Target.of(c), b, out, out.corrections, False))
                 for c, b in zip(cases, blobs)) / len(cases)  # corrections applied as validation applied them
    assert kl == pytest.approx(log["val_kl"][best], rel=1e-5)
    assert all(p.grad is None for p in tiny_pair.consumer.parameters())


def _without_spans(calib):
    out = copy.copy(calib)
    out.spans = None
    out.__dict__.pop("tag", None)
    return out


def test_the_bench_runs_the_span_sweep_with_its_compute_axis(tiny_pair, spanned):
    """``spans``: every span start twice (aligned, producer residual) in the "span sweep" group, each row's
    prefill_share the layers the consumer ran; without span codes the message says how to fit them."""
    from scdviz.scd import bench

    cfg = bench.ScdBenchConfig(cont_len=8, gen_tokens=0, sent_rows=False, qa_answer_len=0, spans=True)
    report = bench.bench(tiny_pair, spanned, [_window(48, 7)], cfg, progress=False)
    rows = report.table().set_index("method")
    swept = rows[rows["group"] == "span sweep"]
    assert list(swept.index) == [p.name for p in plans.span_sweep(spanned)]
    assert swept.loc["SCD span 1-2 (aligned)", "prefill_share"] == pytest.approx(0.667, abs=1e-3)
    assert swept.loc["SCD span 2-2 (producer residual)", "prefill_share"] == pytest.approx(0.333, abs=1e-3)
    assert rows.loc["oracle", "prefill_share"] == 1.0 and rows.loc["raw KV", "prefill_share"] == 0.0
    aligned, fp16 = swept.loc["SCD span 2-2 (aligned)"], swept.loc["SCD span 2-2 (producer residual)"]
    assert aligned["bytes_per_token"] < fp16["bytes_per_token"]  # int4 code vs the fp16 residual
    with pytest.raises(ValueError, match="python -m scdviz span"):
        bench.bench(tiny_pair, _without_spans(spanned), [_window(48, 7)], cfg, progress=False)


def test_each_start_keeps_the_fit_or_the_identity_whichever_has_the_lowerselection_kl(tiny_pair, spanned):
    """The kept code's selection KL is the lower of the two logged, and measured again on the same
    selection windows it is that number; without ``select`` the squared-error fit is kept, unmeasured."""
    info = spanned.stats["spans"]
    assert info["selection_windows"] > 0
    _, _, select = calibration.windows(tiny_pair, spanned.config)
    cases = [transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, w, spanned.config.cont_len)
             for w in select]
    for start in (1, 2):
        row = info["by_start"][str(start)]
        assert row["selection_kl"][row["chosen"]] == min(row["selection_kl"].values())
        again = span.selection_kl(tiny_pair, spanned, start, spanned.spans[start], cases, False)
        assert again == pytest.approx(row["selection_kl"][row["chosen"]], abs=1e-5)
    plain = span.fit(tiny_pair, spanned, span.SpanConfig(starts=[2], select=False), progress=False)[1]
    assert "chosen" not in plain["by_start"]["2"] and plain["selection_windows"] == 0


def test_the_scd_tab_view_shows_the_span_sweep_of_a_calibration_that_has_span_codes(tiny_pair, spanned):
    """The app's one-text view runs the span sweep when (and only when) the calibration has span codes."""
    from scdviz.scd import view

    text = "the quick brown fox jumps over the lazy dog " * 2
    shown = view.transfer_view(tiny_pair, spanned, text, cont_len=8, gen_tokens=0).table()
    assert list(shown[shown["group"] == "span sweep"]["method"]) == [p.name for p in plans.span_sweep(spanned)]
    plain = view.transfer_view(tiny_pair, _without_spans(spanned), text, cont_len=8, gen_tokens=0).table()
    assert "span sweep" not in set(plain["group"])

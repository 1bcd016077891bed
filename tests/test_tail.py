"""Fast tier: a recomputed tail (``Plan.tail``): the consumer runs the last prefix tokens itself over the
cache it received (CacheBlend's token recompute, the latest tokens), on tiny random models."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_scd import window_ids

from scdviz import metrics
from scdviz.models import hf
from scdviz.scd import payload, transfer
from scdviz.scd import plan as plans


def _case(pair, n: int = 48):
    return transfer.prepare_case(pair.producer, pair.consumer, window_ids(n), 8)


def test_a_tail_over_the_whole_prefix_is_the_consumers_own_prefill(tiny_pair):
    """With token 0 recomputed and every other prefix token in the tail nothing of the producer is sent:
    the cache is the consumer's own (to float noise: token 0, then the rest over it), so its continuation is
    the oracle's."""
    case = _case(tiny_pair)
    t = case.state.ids.shape[1]
    plan = plans.with_tail(plans.raw_plan(hf.n_layers(tiny_pair.consumer)), t - 1)
    blob = transfer.build_payload(case.state, plan)
    assert payload.decode(blob).sections[0].data.shape[0] == 0  # no token's K, V travels
    run = transfer.run_plan(tiny_pair.consumer, case, plan)
    raw = transfer.run_plan(tiny_pair.consumer, case, plans.raw_plan(hf.n_layers(tiny_pair.consumer)))
    kl = float(metrics.kl_per_token(case.oracle_logits, run.logits).mean())
    assert kl < 1e-6 and kl < 0.01 * float(metrics.kl_per_token(case.oracle_logits, raw.logits).mean())
    for got, own in zip(hf.cache_kv(run.cache)[0], hf.cache_kv(case.oracle_cache)[0], strict=True):
        torch.testing.assert_close(got, own, rtol=1e-5, atol=1e-5)


def test_the_tail_is_the_consumers_forward_over_the_rows_it_received(tiny_pair):
    """Rows before the tail are exactly those the plan without a tail gives (raw fp16 rows are per token);
    the tail's rows are the consumer's forward of the tail's ids over them; the payload is the tail's rows
    smaller and 4 bytes per tail id larger."""
    case = _case(tiny_pair)
    t, w, n = case.state.ids.shape[1], 9, hf.n_layers(tiny_pair.consumer)
    base = plans.raw_plan(n)
    st, cut = case.state, slice(0, t - w)  # the same producer rows, the prefix without its tail
    cut_state = dataclasses.replace(st, ids=st.ids[:, cut], keys=[k[cut] for k in st.keys],
                                    values=[v[cut] for v in st.values])
    untailed = transfer.receive(tiny_pair.consumer, transfer.build_payload(cut_state, base)).cache
    tailed_blob = transfer.build_payload(case.state, plans.with_tail(base, w))
    tailed = transfer.receive(tiny_pair.consumer, tailed_blob).cache
    expected = hf.clone_cache(tiny_pair.consumer, untailed)
    hf.forward(tiny_pair.consumer, case.state.ids[:, t - w:], cache=expected,
               positions=torch.arange(t - w, t).unsqueeze(0))
    for kind in (0, 1):
        for got, want in zip(hf.cache_kv(tailed)[kind], hf.cache_kv(expected)[kind], strict=True):
            assert got.shape[2] == t
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    d_kv = hf.attn_heads(tiny_pair.consumer)[1] * hf.attn_heads(tiny_pair.consumer)[2]
    full = transfer.build_payload(case.state, base)
    assert len(full) - len(tailed_blob) == w * n * 2 * d_kv * 2 - 4 * w  # fp16 K and V per layer; u32 ids
    assert payload.decode(tailed_blob).layout.tail == case.state.ids[0, t - w:].tolist()


def test_a_tailed_scd_plan_sends_fewer_rows_and_its_compute_share_counts_the_tail(tiny_pair, tiny_calib):
    case = _case(tiny_pair)
    t = case.state.ids.shape[1]
    reuse = plans.operating_plan(tiny_calib, patch_k=0)
    tailed = plans.with_tail(reuse, 11)
    msg = payload.decode(transfer.build_payload(case.state, tailed, tiny_calib))
    assert msg.n_tokens == t - 11 and {s.data.shape[0] for s in msg.sections} == {t - 12}  # token 0 recomputed
    run = transfer.run_plan(tiny_pair.consumer, case, tailed, tiny_calib)
    assert hf.cache_kv(run.cache)[0][0].shape[2] == t
    assert plans.prefill_share(reuse.modes, 11 / t) == pytest.approx(11 / t)
    assert plans.prefill_share(["code", "recompute"], 0.5) == pytest.approx(0.75)  # half the rest runs 1 of 2 layers


def test_a_tail_that_leaves_nothing_to_send_is_refused_with_a_message(tiny_pair):
    case = _case(tiny_pair)
    t = case.state.ids.shape[1]
    plan = plans.with_tail(plans.raw_plan(hf.n_layers(tiny_pair.consumer)), t)
    with pytest.raises(ValueError, match="leaves 0 of this"):
        transfer.build_payload(case.state, plan)
    with pytest.raises(ValueError, match="0 or more"):
        plans.Plan("x", ["raw"], tail=-1)


def test_the_bench_runs_the_tail_sweep_with_its_compute_axis(tiny_pair, tiny_calib):
    """``tails``: raw KV and SCD reuse-only (and transform coded at each budget) with each tail, in the "tail
    sweep" group; a row's prefill_share is its tail's share of the prefix, and its bytes fall as the tail
    grows; a tail longer than the prompt allows is refused before any work."""
    from scdviz.scd import bench

    cfg = bench.ScdBenchConfig(cont_len=8, gen_tokens=0, sent_rows=False, qa_answer_len=0, tails=[4, 16],
                               budgets=(30.0,))
    report = bench.bench(tiny_pair, tiny_calib, [window_ids(48, 7)], cfg, progress=False)
    rows = report.table().set_index("method")
    swept = rows[rows["group"] == "tail sweep"]
    assert list(swept.index) == [p.name for p in plans.tail_sweep(tiny_calib, (4, 16), (30.0,))]
    assert swept.loc["raw KV + last 16 recomputed", "prefill_share"] == pytest.approx(16 / 39, abs=1e-3)
    assert swept.loc["SCD reuse-only + last 4 recomputed", "prefill_share"] == pytest.approx(4 / 39, abs=1e-3)
    for base in ("raw KV", "SCD reuse-only"):
        assert swept.loc[f"{base} + last 16 recomputed", "bytes_per_token"] < swept.loc[
            f"{base} + last 4 recomputed", "bytes_per_token"]
    for tail in (4, 16):  # a budget is per prefix token: the coder spends it on the tokens it sends
        assert swept.loc[f"SCD transform-coded @30 B/token + last {tail} recomputed", "bytes_per_token"] <= 30.0
    assert rows.loc["raw KV + last 4 recomputed", "bytes_per_token"] < rows.loc["raw KV", "bytes_per_token"]
    with pytest.raises(ValueError, match="recomputed tail is 1 to 38"):
        bench.bench(tiny_pair, tiny_calib, [window_ids(48, 7)], bench.ScdBenchConfig(
            cont_len=8, gen_tokens=0, sent_rows=False, qa_answer_len=0, tails=[39]), progress=False)


def test_the_public_codec_carries_a_tail_through_its_bytes(tiny_pair, tiny_calib):
    """``Codec.of(calib, tail=W)``: ``encode`` leaves the last W prefix tokens out, ``decode`` (bytes only, no
    side channel) rebuilds a cache over the whole prefix, the consumer's own forward over the tail."""
    from scdviz.scd.codec import Codec

    ids = torch.tensor([window_ids(40)])
    codec = Codec.of(tiny_calib, tail=7)
    assert codec.plan.tail == 7 and codec.plan.name.endswith("+ last 7 recomputed")
    blob = codec.encode(tiny_pair.producer, ids)
    assert payload.decode(blob).layout.tail == ids[0, -7:].tolist()
    cache = codec.decode(tiny_pair.consumer, blob)
    assert hf.cache_kv(cache)[0][0].shape[2] == 40

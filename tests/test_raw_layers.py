"""Fast tier: raw layers inside an SCD plan (``plans.with_raw``): chosen layers travel as the producer's own
K, V (quantised as 4-bit KV is, or fp16) instead of their REUSE code, on tiny random models."""

from __future__ import annotations

import pytest
import torch
from test_scd import window_ids

from scdviz.models import hf
from scdviz.scd import payload, transfer
from scdviz.scd import plan as plans


@pytest.mark.parametrize("bits", [4, 16])
def test_raw_layers_are_the_producers_kv_and_the_rest_the_plans_own(tiny_pair, tiny_calib, bits):
    """At the raw layers the consumer's cache is exactly raw reuse's at those bits (4-bit KV, or the
    producer's fp16 K, V); at every other layer exactly the SCD plan's; the payload's header says "raw"
    there and nothing else changes."""
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window_ids(), 8)
    n = hf.n_layers(tiny_pair.consumer)
    base = plans.operating_plan(tiny_calib, patch_k=0, name="SCD reuse-only")
    mixed = plans.with_raw(base, [1], bits)
    assert mixed.modes == ["raw" if i == 1 else m for i, m in enumerate(base.modes)] and "code" in mixed.modes
    assert mixed.name == "SCD reuse-only + raw layers 1" + (" (4-bit)" if bits == 4 else "")
    assert plans.base_name(mixed.name + plans.CLOSED) == base.name + plans.CLOSED  # what its row is compared with
    raw = plans.raw_plan(n, bits=bits)
    got, own, reuse = (hf.cache_kv(transfer.transferred(tiny_pair.consumer, case.state, p, tiny_calib))
                       for p in (mixed, raw, base))
    for layer in range(n):
        want = own if layer == 1 else reuse
        for side in (0, 1):  # keys, values
            assert torch.equal(got[side][layer], want[side][layer]), (layer, side)
    blob = transfer.build_payload(case.state, mixed, tiny_calib)
    assert payload.decode(blob).layout.modes == mixed.modes


def test_raw_layers_are_refused_outside_the_model_and_swept_by_the_bench(tiny_pair, tiny_calib):
    """A raw layer the model does not have is refused by name, in the plan and in the bench (before any
    work); the bench's "raw layers" group holds reuse-only, full and transform coded at each budget with
    those layers raw, the budget still a hard limit on the real payload."""
    from scdviz.scd import bench

    n = tiny_calib.n_layers
    with pytest.raises(ValueError, match=f"raw layers are 0 to {n - 1}"):
        plans.with_raw(plans.operating_plan(tiny_calib), [n])
    cfg = bench.ScdBenchConfig(cont_len=8, gen_tokens=0, sent_rows=False, qa_answer_len=0, raw_layers=[0],
                               budgets=(30.0,))
    report = bench.bench(tiny_pair, tiny_calib, [window_ids(48, 7)], cfg, progress=False)
    rows = report.table().set_index("method")
    swept = rows[rows["group"] == "raw layers"]
    assert list(swept.index) == [p.name for p in plans.raw_layer_sweep(tiny_calib, [0], 4, (30.0,))]
    assert swept.loc["SCD transform-coded @30 B/token + raw layers 0 (4-bit)", "bytes_per_token"] <= 30.0
    with pytest.raises(ValueError, match=f"--raw-layers are 0 to {n - 1}"):
        bench.bench(tiny_pair, tiny_calib, [window_ids(48, 7)], bench.ScdBenchConfig(
            cont_len=8, gen_tokens=0, sent_rows=False, qa_answer_len=0, raw_layers=[n]), progress=False)


def test_the_view_adds_the_raw_layer_rows_and_refuses_an_unknown_sweep(tiny_pair, tiny_calib):
    """``transfer_view(..., extra={"raw_layers": [...]})``: the one text's table gains the raw-layer group,
    equal to the bench's rows on the same window; a sweep the view does not run is refused by name."""
    from scdviz.scd import view

    text = " ".join(["the cat sat on the mat and looked at the dog"] * 6)
    table = view.transfer_view(tiny_pair, tiny_calib, text, cont_len=8, gen_tokens=0,
                               extra={"raw_layers": [1]}).table().set_index("method")
    assert list(table[table["group"] == "raw layers"].index) == [
        "SCD reuse-only + raw layers 1 (4-bit)", "SCD full + raw layers 1 (4-bit)"]
    with pytest.raises(ValueError, match="not \\['budgets'\\]"):
        view.transfer_view(tiny_pair, tiny_calib, text, cont_len=8, gen_tokens=0, extra={"budgets": [30.0]})

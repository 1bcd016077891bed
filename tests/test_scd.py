"""Fast tier: SCD maths, wire format and the transfer machinery on tiny random models."""

from __future__ import annotations

import copy
import dataclasses
import json
import struct

import pandas as pd
import pytest
import torch
from conftest import tiny_model

from scdviz import artefact, metrics
from scdviz.models import hf
from scdviz.models.pair import Pair, PairError, facts_of
from scdviz.scd import calibrate as cal
from scdviz.scd import calibration, measure, payload, quant, rrr, transfer
from scdviz.scd import plan as plans
from scdviz.scd.patch import Aligner, Patch
from scdviz.scd.rrr import allocate_ranks, fit_rrr


class CharTokenizer:
    """Bytes modulo the tiny vocabulary; enough for token_windows and facts_of."""

    all_special_tokens = ["<s>"]

    def get_vocab(self):
        return {chr(32 + i): i for i in range(97)}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [b % 97 for b in text.encode()]}


def perturbed(seed: int, scale: float = 0.3):
    """The tiny Llama with every weight nudged: a stand-in fine-tuned consumer."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return model


def make_pair(producer, consumer, name: str = "tiny:c") -> Pair:
    tok = CharTokenizer()
    return Pair(producer, consumer, tok, "tiny:p", name, facts_of(producer, tok), facts_of(consumer, tok),
                torch.device("cpu"), torch.float32)


def small_cfg(texts: str, **kw) -> calibration.CalibConfig:
    base = dict(texts=texts, n_fit=6, n_select=2, prompt_len=40, cont_len=8, n_candidates=2,
                patch_k=2, op_patch_k=1)
    return calibration.CalibConfig(**{**base, **kw})


def window_ids(n: int = 48, seed: int = 3) -> list[int]:
    """A seeded window of token ids of the tiny models' vocabulary (test_tail uses it too)."""
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------- pure maths


def test_rrr_fit_error_matches_reconstruction_and_never_increases_with_rank():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 12, generator=g)
    y = x @ torch.randn(12, 10, generator=g) + 0.3 * torch.randn(400, 10, generator=g)
    code = fit_rrr(x, y, ridge=1e-3)
    yc = y - y.mean(0)
    for rank in range(code.max_rank + 1):
        direct = ((code.decode(code.encode(x, rank)) - y) ** 2).sum() / (yc**2).sum()
        assert abs(float(direct) - float(code.fit_err[rank])) < 1e-4
    assert torch.all(code.fit_err[1:] <= code.fit_err[:-1] + 1e-7)
    assert torch.all(code.spectrum[1:] <= code.spectrum[:-1])
    for shrink in (0.0, 0.5):  # a lower-rank fit is the higher-rank one truncated (choose_joint scores ranks so)
        st = rrr.RRRStats(12, 12)
        st.add(x, x @ torch.randn(12, 12, generator=g) + 0.3 * torch.randn(400, 12, generator=g))
        for rank in (1, 4, 7):
            low, cut = st.fit(1e-3, rank, shrink), st.fit(1e-3, 12, shrink).truncated(rank)
            for name in ("mu_in", "mu_out", "enc", "dec", "spectrum", "fit_err"):
                torch.testing.assert_close(getattr(low, name), getattr(cut, name))


def test_rank_allocation_meets_the_budget_and_favours_the_harder_code():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 8, generator=g)
    easy = fit_rrr(x, x[:, :8] @ torch.diag(torch.tensor([5.0, 1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])))
    hard = fit_rrr(x, x @ torch.randn(8, 8, generator=g))
    ranks = allocate_ranks([easy, hard], 8)
    assert sum(ranks) == 8 and ranks[1] > ranks[0]


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("axis", quant.AXES)
def test_quantisation_error_is_within_half_a_step(bits, axis):
    x = torch.randn(37, 19)
    blob, lo, step = quant.quantize(x, bits, 8, axis)
    back = quant.dequantize(blob, lo, step, (37, 19), bits, 8, axis)
    assert len(blob) == quant.packed_len(37 * 19, bits)
    assert lo.numel() == quant.n_groups(37, 19, 8, axis)
    assert (back - x).abs().max() <= step.float().max() * 0.5 + 2e-2


def test_bit_packing_is_dense_little_endian_and_round_trips():
    q = torch.tensor([1, 2, 3, 0, 15, 7], dtype=torch.uint8)
    assert quant.pack(q, 4) == bytes([0x21, 0x03, 0x7F])  # low nibble first
    assert quant.pack(q[:4], 2) == bytes([0b00111001])  # four 2-bit values in one byte
    for bits in quant.BITS:
        vals = torch.randint(0, 2**bits, (101,), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
        blob = quant.pack(vals, bits)
        assert len(blob) == quant.packed_len(101, bits)
        assert torch.equal(quant.unpack(blob, bits, 101), vals)
    with pytest.raises(ValueError, match="unsupported bit width 5"):
        quant.pack(q, 5)
    blob, lo, step = quant.quantize(torch.zeros(9, 0), 3, 4, "channel")  # a rank-0 code section
    assert blob == b"" and lo.numel() == 0 and quant.dequantize(blob, lo, step, (9, 0), 3, 4, "channel").shape == (9, 0)


def test_entropy_coded_sections_decode_to_the_same_values_and_are_never_longer():
    g = torch.Generator().manual_seed(4)
    peaked = torch.randn(200, 24, generator=g) ** 3 * torch.linspace(0.1, 3, 24)  # heavy tails, channel scales differ
    flat = torch.rand(200, 24, generator=g)
    tiny = torch.randn(3, 2, generator=g)
    for x, bits in ((peaked, 3), (peaked, 4), (flat, 8), (tiny, 4), (torch.zeros(50, 0), 2)):
        plain = [payload.Section(1, "k_code", x, bits, 16, "channel")]
        coded = [payload.Section(1, "k_code", x, bits, 16, "channel", coded=True)]
        a, b = payload.encode(payload.Layout(50, 7), plain), payload.encode(payload.Layout(50, 7), coded)
        assert len(b) <= len(a) == payload.payload_len(plain)
        assert torch.equal(payload.decode(a).sections[0].data, payload.decode(b).sections[0].data)  # lossless
    a = payload.encode(payload.Layout(50, 7), [payload.Section(1, "k_code", peaked, 3, 64, "channel")])
    b = payload.encode(payload.Layout(50, 7), [payload.Section(1, "k_code", peaked, 3, 64, "channel", coded=True)])
    assert len(b) < 0.95 * len(a)  # a peaked histogram codes below 3 bits per value
    assert payload.decode(b).sections[0].coded and not payload.decode(a).sections[0].coded
    with pytest.raises(ValueError, match="truncated"):
        payload.decode(b[:-9])


def test_transform_coded_sections_decode_within_half_a_step_and_drop_the_channels_they_zero():
    from scdviz.scd import entropy

    g = torch.Generator().manual_seed(6)
    z = torch.randn(120, 32, generator=g) * torch.logspace(1, -3, 32)  # channel scales fall, like a code's spectrum
    lengths, sent = [], []
    for step in (2e-3, 0.01, 0.1, 1.0, 10.0, 1e3):
        blob = payload.encode(payload.Layout(121, 7), [payload.Section(2, "v_code", z, 0, step=step)])
        got = payload.decode(blob).sections[0]
        cols = got.data.shape[1]
        assert ((got.kind, got.bits, got.data.shape[0]) == ("v_code", 0, 120)
                and got.step == pytest.approx(step, rel=1e-6))
        assert ((got.data - z[:, :cols]).abs() <= step / 2 * (1 + 1e-5)).all()  # a uniform quantiser
        assert (z[:, cols:].abs() < step / 2).all()  # only channels that round to zero everywhere are left out
        q = entropy.quantise_uniform(z, struct.unpack("<f", struct.pack("<f", step))[0])
        # a few words
        assert abs(len(blob) - payload.header_len(0) - payload.SECTION.size - entropy.estimated_len(q)) <= 64
        lengths.append(len(blob))
        sent.append(cols)
    # coarser: fewer bytes, lower rank
    assert lengths == sorted(lengths, reverse=True) and sent == sorted(sent, reverse=True)
    assert sent[0] == 32 and sent[-1] == 0
    blob = payload.encode(payload.Layout(121, 7), [payload.Section(2, "v_code", z, 0, step=0.1)])
    with pytest.raises(ValueError, match="truncated"):
        payload.decode(blob[:-5])
    with pytest.raises(ValueError, match="depends on its data"):
        payload.payload_len([payload.Section(2, "v_code", z, 0, step=0.1)])


def test_transform_coded_plan_is_a_hard_byte_limit_and_its_error_falls_as_the_budget_rises(tiny_pair, tiny_calib):
    import dataclasses

    assert tiny_calib.rate is not None

    calib = tiny_calib  # calibrated with its rate curves (rate_windows)
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window_ids(60), 8)
    n_tokens = case.state.ids.shape[1]
    full = plans.full_rank_plan(calib)
    exact = dataclasses.replace(full, code_bits=16)  # what the codes give with no quantisation at all
    ref_k, ref_v = hf.cache_kv(transfer.receive(tiny_pair.consumer, transfer.build_payload(case.state, exact, calib),
                                                calib).cache)
    errors = []
    for budget in (8.0, 16.0, 32.0, 64.0):
        plan = plans.tc_plan(calib, budget)
        blob = transfer.build_payload(case.state, plan, calib)
        assert budget * 0.97 <= len(blob) / n_tokens <= budget  # headers included; it spends what it is given
        keys, values = hf.cache_kv(transfer.receive(tiny_pair.consumer, blob, calib).cache)
        errors.append(sum(float(((a - b) ** 2).sum()) for a, b in zip(keys + values, ref_k + ref_v)))
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.05 * errors[0]
    with pytest.raises(ValueError, match="below the smallest transform-coded payload"):
        transfer.build_payload(case.state, plans.tc_plan(calib, 0.5), calib)


def test_transform_coding_gives_the_more_sensitive_layer_a_finer_step(tiny_calib):
    import dataclasses

    curves = tiny_calib.rate
    loud = dataclasses.replace(curves, sens_k=curves.sens_k.clone())
    loud.sens_k[1] *= 100
    a = plans.tc_plan(dataclasses.replace(tiny_calib, rate=curves), 30.0)
    b = plans.tc_plan(dataclasses.replace(tiny_calib, rate=loud), 30.0)
    assert b.steps_k[1] == pytest.approx(a.steps_k[1] / 10)  # step ∝ 1/sqrt(KL per unit of squared error)
    assert b.steps_k[0] == a.steps_k[0] and b.steps_v == a.steps_v
    with pytest.raises(ValueError, match="needs the calibration's sensitivities"):
        plans.tc_plan(dataclasses.replace(tiny_calib, rate=None), 30.0)


def test_payload_length_equals_the_format_formula():
    g = torch.Generator().manual_seed(2)
    sections = [
        payload.Section(0, "k", torch.randn(33, 24, generator=g), 4, 32, "channel"),
        payload.Section(0, "v", torch.randn(33, 24, generator=g), 4, 32, "token"),
        payload.Section(1, "k_code", torch.randn(33, 7, generator=g), 8, 64, "channel"),
        payload.Section(2, "resid", torch.randn(34, 32, generator=g), 16),
    ]
    blob = payload.encode(payload.Layout(34, 5), sections)
    expected = 27 + sum(13 + (2 * r * c if b == 16 else -(-r * c * b // 8) + 4 * quant.n_groups(r, c, gr, ax))
                        for r, c, b, gr, ax in [(*s.data.shape, s.bits, s.group, s.axis) for s in sections])
    assert len(blob) == payload.payload_len(sections) == expected
    msg = payload.decode(blob)
    assert (msg.n_tokens, msg.token0, [s.kind for s in msg.sections]) == (34, 5, ["k", "v", "k_code", "resid"])
    torch.testing.assert_close(msg.sections[3].data, sections[3].data.half().float())
    with pytest.raises(ValueError, match="magic"):
        payload.decode(b"nope" + blob[4:])
    with pytest.raises(ValueError, match="format 1"):  # the first format's messages did not say how layers were sent
        payload.decode(b"SCD1" + blob[4:])
    with pytest.raises(ValueError, match="format 2"):  # the second's had no recomputed tail
        payload.decode(b"SCD2" + blob[4:])
    # the header's layout: one byte per layer, the sink rule and the calibration travel with the sections
    head = payload.Layout(34, 5, ["raw", "code", "patch", "recompute", "recompute"], "recompute", 0xABCDEF0123)
    blob = payload.encode(head, sections)
    assert len(blob) == payload.payload_len(sections, 5) == expected + 5
    assert payload.decode(blob).layout == head
    with pytest.raises(ValueError, match="truncated"):
        payload.decode(blob[:29])
    # a recomputed tail: its token ids (u32: any vocabulary) travel in the header, 4 bytes each
    head = payload.Layout(34, 5, ["raw", "code"], "recompute", 7, tail=[3, 70000, 49151])
    blob = payload.encode(head, sections)
    assert len(blob) == payload.payload_len(sections, 2, 3) == expected + 2 + 12
    assert payload.decode(blob).layout == head
    with pytest.raises(ValueError, match="truncated"):
        payload.decode(blob[: 27 + 2 + 8])


def test_plan_rejects_unknown_modes():
    with pytest.raises(ValueError, match="unknown layer mode"):
        plans.Plan("x", ["raw", "bogus"])
    assert plans.droidspeak_plan(5, [1, 2, 4]).runs() == [(1, 3), (4, 5)]
    assert plans.contiguous_block([0, 5, 1, 4, 4], 2) == [3, 4]


# ----------------------------------------------------------------------------- machinery


@pytest.mark.parametrize("sink", plans.SINKS)
def test_same_model_full_rank_reproduces_the_oracle_logits(texts, sink):
    model = tiny_model("llama")
    pair = make_pair(model, model)
    calib = cal.calibrate(small_cfg(texts, ridge=0.0, given=[1]), pair, progress=False)
    case = transfer.prepare_case(model, model, window_ids(), 8)
    rk, rv = plans.full_ranks(calib)
    for plan in (plans.scd_plan(rk, rv, code_bits=16, sink=sink), plans.raw_plan(3, sink=sink),
                 plans.droidspeak_plan(3, [1, 2], sink)):
        run = transfer.run_plan(model, case, plan, calib)
        torch.testing.assert_close(run.logits, case.oracle_logits, atol=2e-3, rtol=1e-3)


def test_oracle_aligner_makes_the_patched_layer_kv_equal_the_oracle(tiny_pair, tiny_calib):
    layer = 1
    d = tiny_pair.consumer.config.hidden_size
    ones, zeros = torch.ones(d), torch.zeros(d)
    identity = Patch(layer, zeros, ones, zeros, ones, None, Aligner(d).eval(), 0.0)
    calib = dataclasses.replace(tiny_calib, patches={layer: identity})
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window_ids(), 8)
    case.state = transfer.producer_state(tiny_pair.consumer, case.state.ids)  # the true consumer H_in
    rk, rv = plans.full_ranks(calib)
    plan = plans.scd_plan(rk, rv, [layer], code_bits=16)
    got = transfer.receive(tiny_pair.consumer, transfer.build_payload(case.state, plan, calib), calib).cache
    own = case.oracle_cache.layers[layer]
    torch.testing.assert_close(got.layers[layer].keys, own.keys, atol=5e-3, rtol=1e-3)
    torch.testing.assert_close(got.layers[layer].values, own.values, atol=5e-3, rtol=1e-3)


def test_sink_recompute_gives_the_consumer_its_own_token0(tiny_pair):
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window_ids(), 8)
    plan = plans.raw_plan(3, sink="recompute")
    got = transfer.receive(tiny_pair.consumer, transfer.build_payload(case.state, plan)).cache
    sent = hf.forward(tiny_pair.producer, case.state.ids).cache.layers
    for mine, own, prod in zip(got.layers, case.oracle_cache.layers, sent):
        torch.testing.assert_close(mine.keys[:, :, :1], own.keys[:, :, :1])
        torch.testing.assert_close(mine.values[:, :, :1], own.values[:, :, :1])
        torch.testing.assert_close(mine.keys[:, :, 1:], prod.keys[:, :, 1:], atol=2e-3, rtol=1e-3)
        assert not torch.allclose(mine.keys[:, :, :1], prod.keys[:, :, :1])


def test_every_method_runs_through_the_same_machinery(tiny_pair, tiny_calib):
    cases = measure.prepare_cases(tiny_pair, [window_ids(48, s) for s in range(2)], 8, progress=False)
    lineup = plans.lineup(tiny_calib)
    assert [p.name for p in lineup] == ["raw KV", "4-bit KV", "DroidSpeak recompute", "SCD reuse-only", "SCD full"]
    for plan in lineup:
        blob = transfer.build_payload(cases[0].state, plan, tiny_calib)
        msg = payload.decode(blob)
        assert len(blob) == payload.payload_len(msg.sections, len(msg.layout.modes))
        got = transfer.receive(tiny_pair.consumer, blob, tiny_calib)
        assert hf.cache_len(got.cache) == [cases[0].state.ids.shape[1]] * 3
    oracle, gens = measure.oracle_result(tiny_pair, cases, 4)
    results = measure.run_methods(tiny_pair, tiny_calib, cases, lineup, gen_tokens=4, oracle_gen=gens, progress=False)
    df = measure.table([oracle, *results])
    assert list(df["method"]) == ["oracle"] + [p.name for p in lineup]
    raw, four = results[0], results[1]
    assert raw.payload_bytes_per_token > four.payload_bytes_per_token > 0
    assert all(r.kl >= 0 and 0 <= r.top1 <= 1 for r in results)
    assert len(raw.divergence) == 4 and len(raw.amplification()) == 3
    # the oracle row is measured through the same path (not written down): its own cache reproduces itself
    assert oracle.kl == 0 and oracle.top1 == 1 and max(oracle.drift_k + oracle.drift_v + oracle.divergence) == 0
    assert raw.kl > 0 and max(raw.divergence) > 0


def test_saved_calibration_round_trips_and_refuses_another_pair(tiny_pair, tiny_calib, tmp_path):
    tiny_calib.save(tmp_path / "c")
    back = calibration.Calibration.load(tmp_path / "c", tiny_pair)
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window_ids(), 8)
    plan = plans.operating_plan(back)
    a = transfer.run_plan(tiny_pair.consumer, case, plan, tiny_calib)
    b = transfer.run_plan(tiny_pair.consumer, case, plan, back)
    assert a.payload_bytes == b.payload_bytes
    assert float(metrics.kl_per_token(a.logits, b.logits).max()) < 1e-3
    assert tiny_calib.rate is not None and back.rate.bits == tiny_calib.rate.bits  # the planner's curves travel with it
    for name in ("err_k", "err_v", "patch_err", "sens_k", "sens_v"):
        assert torch.equal(getattr(back.rate, name), getattr(tiny_calib.rate, name))
    assert plans.rd_plan(back.rate, 30.0, 47)[0] == plans.rd_plan(tiny_calib.rate, 30.0, 47)[0]
    other = make_pair(tiny_pair.producer, perturbed(2), "tiny:other")
    with pytest.raises(PairError, match="(?s)made for producer 'tiny:p' -> consumer 'tiny:c'.*consumer weights"):
        calibration.Calibration.load(tmp_path / "c", other)
    with pytest.raises(ValueError, match="no SCD calibration"):
        calibration.Calibration.load(tmp_path / "missing", tiny_pair)


def test_linear_aligners_round_trip_exactly_and_an_mlp_aligner_is_refused_by_name(tiny_calib, tmp_path):
    """Aligners are identity + a linear correction (the seed's MLP on top left in the one-recipe cleanup,
    docs/history.md): saved and loaded, each decodes as its int8-row correction and fp16 bias do; a file whose
    aligner still holds MLP weights is refused, naming the layer."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    calib = copy.deepcopy(tiny_calib)
    assert calib.patches
    first = min(calib.patches)
    calib.save(tmp_path / "c")
    back = calibration.Calibration.load(tmp_path / "c")
    x = torch.randn(16, calib.patches[first].in_mean.numel())
    for layer, p in calib.patches.items():
        assert set(back.patches[layer].aligner.state_dict()) == {"lin.weight", "lin.bias"}
        p16 = copy.deepcopy(p)  # the bias is stored in fp16, the linear correction in int8 rows
        stored = {k: v.half().float() for k, v in p.aligner.state_dict().items()}
        stored["lin.weight"] = artefact.from_int8_rows(*artefact.int8_rows(p.aligner.lin.weight.detach()))
        p16.aligner.load_state_dict(stored)
        assert torch.equal(back.patches[layer].decode(back.patches[layer].encode(x)), p16.decode(p16.encode(x)))
    path = tmp_path / "c" / calibration.FILE
    with safe_open(str(path), "pt") as fh:
        tensors, meta = {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()
    tensors[f"p.{first}.aligner.up.weight"] = torch.zeros(8, x.shape[1])
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError, match=f"aligner of layer {first} has an MLP"):
        calibration.Calibration.load(tmp_path / "c")


def test_budget_plan_fits_its_byte_budget(tiny_pair, tiny_calib):
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window_ids(138), 8)  # 128 code rows
    for budget in (20.0, 40.0):
        plan = plans.operating_plan(tiny_calib, budget_bytes=budget)
        per_token = len(transfer.build_payload(case.state, plan, tiny_calib)) / case.state.ids.shape[1]
        assert budget - 1.0 <= per_token <= budget + 1.0  # section headers only


def test_bench_records_carry_the_issue_fields_and_a_labelled_projection(tiny_pair, tiny_calib):
    from scdviz.scd import bench

    report = bench.bench(tiny_pair, tiny_calib, [window_ids(48, 7)],
                         bench.ScdBenchConfig(cont_len=8, gen_tokens=2, sweeps=True, budgets=(30.0,), sent_rows=True,
                                              qa_answer_len=0), progress=False)
    recs = bench.rows(report)
    measured = [r for r in recs if r.get("row") == "measured"]
    need = {"specialist", "method", "payload_bytes_per_token", "compression_vs_fp16", "kl", "top1", "ppl", "ppl_oracle",
            "ttft_s_1gbps", "ttft_s_10gbps", "ttft_s_100gbps", "speedup_vs_oracle_10gbps", "n_prompts", "n_tokens"}
    assert all(need <= set(r) for r in measured)
    assert {r["group"] for r in measured} == {"method", "token 0", "patch sweep", "DroidSpeak sweep", "budget sweep"}
    n_tokens = report.methods[0].prompt_tokens  # one window: the tokens its payloads carry
    for r in (r for r in measured if r["method"] != "oracle"):  # the per-layer account adds up to the real payload
        per_layer = sum(sum(r["sent"][f"bytes_{kind}"]) for kind in "kvh")
        assert (per_layer + payload.header_len(tiny_calib.n_layers) / n_tokens  # each entry kept to 1/100
                == pytest.approx(r["payload_bytes_per_token"], abs=0.005 * 3 * tiny_calib.n_layers)), r["method"]
    tc = next(r for r in measured if r["method"].startswith("SCD transform-coded"))
    assert max(tc["sent"]["cols_k"] + tc["sent"]["cols_v"]) <= max(tiny_calib.key_codes[0].max_rank, 1)
    raw_row = next(r for r in measured if r["method"] == "raw KV")
    assert set(raw_row["sent"]["cols_k"]) == {tiny_pair.consumer_facts.kv_heads * tiny_pair.consumer_facts.head_dim}
    budget = bench.budget_table([report])
    assert list(budget["method"]) == ["SCD transform-coded @30 B/token", "SCD RD @30 B/token",
                                      "SCD RD+entropy @30 B/token", "SCD rank-only @30 B/token"]
    assert budget["bytes"].iloc[0] <= 30.0  # transform coding: a hard limit too
    assert budget["bytes"].iloc[2] <= budget["bytes"].iloc[1] <= 30.0  # a hard limit; coding never adds bytes
    assert budget["kl"].iloc[2] == budget["kl"].iloc[1]  # lossless: the same plan decodes to the same cache
    raw = next(r for r in report.methods if r.method == "raw KV")
    assert budget["vs_raw"].iloc[1] == round(report.sweeps[-3].kl / raw.kl, 3)
    assert all(p.sink == "recompute" for p in report.plans.values())  # every method treats token 0 alike
    sent = [r for r in measured if r["group"] == "token 0"]
    assert len(sent) == len(report.plans) and all(r["method"].endswith(plans.SENT) for r in sent)
    for r in measured:
        if r["group"] == "DroidSpeak sweep":
            assert r["modes"].count("recompute") == int(r["method"].split("k=")[1])
    proj = [r for r in recs if r.get("row") == "projection"]
    own = [r for r in proj if r["model"].startswith("this pair")]  # the loaded pair's own shape comes first
    assert proj[0]["model"] == own[0]["model"] and f"{tiny_pair.consumer_facts.params / 1e6:.3g}M" in own[0]["model"]
    assert {r["model"] for r in proj} - {own[0]["model"]} == {"Mistral-7B", "Llama-3-8B", "Qwen-32B"}
    assert all(r["label"].startswith("analytic projection") for r in proj)
    assert len(report.table()) == len(measured)


def test_link_time_and_projection_follow_bytes():
    from scdviz import link

    fast, slow = link.Link(100, 0.0), link.Link(1, 0.0)
    assert fast.seconds(1e9) == pytest.approx(0.08) and slow.seconds(1e9) == pytest.approx(8.0)
    big, gpu = link.LARGE_MODELS[0], link.GPUS[0]
    a = link.project(big, gpu, 4096, 2.0, 0.0, link.Link(10))
    b = link.project(big, gpu, 4096, 8.0, 0.0, link.Link(10))
    assert b["speedup"] > a["speedup"] and a["oracle_ttft_s"] == b["oracle_ttft_s"]


def test_rank_spectra_start_at_full_error_and_each_rank_helps_less(tiny_calib):
    """Directions are ordered by their gain, so the drops of the fit error never grow with rank."""
    df = measure.spectra(tiny_calib)
    d_kv = 2 * 8
    assert len(df) == 2 * 3 * (d_kv + 1)
    assert (df[df["rank"] == 0]["fit_err"] == 1.0).all()
    for _, g in df.groupby(["layer", "kind"]):
        errs = g.sort_values("rank")["fit_err"].tolist()
        drops = [a - b for a, b in zip(errs, errs[1:])]
        assert all(d2 <= d1 + 1e-6 for d1, d2 in zip(drops, drops[1:]))


def _shifted_domains(seed: int = 0, n: int = 400, d: int = 12):
    """Producer rows of two domains (different input statistics) and a consumer that is the
    producer plus a small linear change plus noise: a map fitted on one domain overfits it."""
    gen = torch.Generator().manual_seed(seed)
    change = torch.eye(d) + 0.05 * torch.randn(d, d, generator=gen)
    out = []
    for scale in (torch.linspace(0.2, 3, d), torch.linspace(3, 0.2, d)):
        x = torch.randn(n, d, generator=gen) * scale
        out.append((x, x @ change + 0.5 * torch.randn(n, d, generator=gen)))
    return out


def test_heldout_error_is_the_direct_error_and_shrinkage_reaches_identity():
    (xa, ya), (xb, yb) = _shifted_domains()
    a, b = rrr.RRRStats(12, 12), rrr.RRRStats(12, 12)
    a.add(xa, ya)
    b.add(xb, yb)
    for shrink in (0.0, 0.3, float("inf")):
        mu_x, mu_y, m = a.full_map(1e-3, shrink)
        direct = ((((xb.double() - mu_x) @ m + mu_y - yb.double()) ** 2).sum()
                  / ((yb.double() - yb.double().mean(0)) ** 2).sum())
        assert b.heldout_error(mu_x, mu_y, m) == pytest.approx(float(direct), rel=1e-9)
    assert torch.equal(a.full_map(1e-3, float("inf"))[2], torch.eye(12, dtype=torch.float64))
    assert torch.allclose(a.full_map(1e-3, 1e9)[2], torch.eye(12, dtype=torch.float64), atol=1e-6)
    both = a + b
    ref = rrr.RRRStats(12, 12)
    ref.add(torch.cat([xa, xb]), torch.cat([ya, yb]))
    assert torch.allclose(both.sxx, ref.sxx) and torch.allclose(both.sxy, ref.sxy) and both.n == ref.n


def test_block_and_residual_statistics_are_those_of_the_rows():
    """block() and residual_of() give exactly the sums of the sliced / transformed rows."""
    (x, y), _ = _shifted_domains(d=8)
    st = rrr.RRRStats(8, 8)
    st.add(x, y)
    cols = slice(2, 5)
    want = rrr.RRRStats(8, 3)
    want.add(x, y[:, cols])
    got = st.block(slice(None), cols)
    for name in ("sx", "sy", "sxx", "sxy", "syy"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name))
    mu_x, mu_y, b = st.full_map(1e-3, 0.3)
    y_hat = (x.double() - mu_x) @ b + mu_y
    want = rrr.RRRStats(8, 8)
    want.add(y_hat, y.double() - y_hat)
    got = st.residual_of(mu_x, b, mu_y)
    for name in ("sx", "sy", "sxx", "sxy", "syy"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-9, atol=1e-6)


def test_joint_refinement_is_the_joint_least_squares_map_at_full_rank_and_helps_when_k_and_v_share_a_source():
    """Keys and values are two projections of one hidden state: the consumer's keys depend on what
    only the producer's values carry. The block-diagonal maps cannot use it; the joint refinement,
    fitted on the first map's output, recovers the joint least-squares map exactly at full rank."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(600, 10, generator=gen)
    pk, pv = torch.randn(10, 4, generator=gen), torch.randn(10, 4, generator=gen)
    ck, cv = pk + 0.5 * torch.randn(10, 4, generator=gen), pv + 0.5 * torch.randn(10, 4, generator=gen)
    x = torch.cat([h @ pk, h @ pv], 1)
    y = torch.cat([h @ ck, h @ cv], 1) + 0.05 * torch.randn(600, 8, generator=gen)
    st = rrr.RRRStats(8, 8)
    st.add(x, y)
    block = cal.joint_map(st, 1e-9, 0.0, 0.0, None, 8)
    full = cal.joint_map(st, 1e-9, 0.0, 0.0, 0.0, 8)
    torch.testing.assert_close(full[2], st.full_map(1e-9, 0.0)[2], rtol=1e-6, atol=1e-6)  # the joint map
    assert st.heldout_error(*full[:3]) < 0.5 * st.heldout_error(*block[:3])
    low = [st.heldout_error(*cal.joint_map(st, 1e-9, 0.0, 0.0, 0.0, r)[:3]) for r in (1, 2, 4, 8)]
    assert all(a >= b - 1e-9 for a, b in zip(low, low[1:]))  # error falls as the refinement's rank rises
    assert cal.joint_map(st, 1e-9, 0.0, 0.0, 1e9, 8)[2].sub(block[2]).abs().max() < 1e-5  # β → ∞: no refinement


def test_received_code_layers_carry_the_joint_refinement(tiny_pair, tiny_calib, tmp_path):
    """The consumer adds the stored refinement to the decoded rows; it survives save / load (int8 codes)."""
    assert tiny_calib.stats["joint_layers"], "the tiny pair's calibration should refine some layer"
    layer = tiny_calib.stats["joint_layers"][0]
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window_ids(48, 3), 8)
    plan = plans.full_rank_plan(tiny_calib)
    plain = copy.deepcopy(tiny_calib)
    plain.joint = None
    got = [hf.layer_kv(transfer.receive(tiny_pair.consumer, transfer.build_payload(case.state, plan, c), c).cache,
                       layer)
           for c in (tiny_calib, plain)]
    code = tiny_calib.joint[layer]
    rows = torch.cat([hf.unrotate(got[1][0],
                                  *hf.rope(tiny_pair.consumer, torch.arange(case.state.ids.shape[1])[None]))[0]
                      .transpose(0, 1).flatten(1), got[1][1][0].transpose(0, 1).flatten(1)], 1)[1:]
    sent = {s.kind: s for s in payload.decode(transfer.build_payload(case.state, plan, tiny_calib)).sections
            if s.layer == layer}
    # int4 codes: weighed for their noise
    gain = tiny_calib.refine_gain(layer, (sent["k_code"].noise, sent["v_code"].noise))
    assert 0 < gain < 1
    want = rows + gain * code.decode(code.encode(rows, code.max_rank))
    d = rows.shape[1] // 2
    torch.testing.assert_close(got[0][1][0].transpose(0, 1).flatten(1)[1:], want[:, d:], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got[0][1], got[1][1])
    table = tiny_calib.stats["joint_lodo_error"]
    rank, chosen = tiny_calib.stats["joint_rank"], tiny_calib.stats["joint_shrink"]
    # chosen by held-out error
    assert table["none" if chosen is None else f"rank {rank}, {chosen:g}"] == min(table.values())
    assert ({c.max_rank for c in tiny_calib.joint if c is not None}
            == {min(rank, tiny_calib.key_codes[0].mu_out.numel() * 2)})
    assert len(table) == 1 + len(tiny_calib.config.joint_rank_grid) * len(tiny_calib.config.joint_shrink_grid)
    tiny_calib.save(tmp_path / "c")
    back = calibration.Calibration.load(tmp_path / "c")
    assert [c is None for c in back.joint] == [c is None for c in tiny_calib.joint]
    for name, by in (("enc", 0), ("dec", 1)):  # int8 per rank component: within half a step (absmax / 127) plus
        want, got = getattr(code, name), getattr(back.joint[layer], name)  # the fp16 scale's rounding x 127 steps
        step = want.abs().amax(by, keepdim=True) / 127
        assert ((got - want).abs() <= (0.5 + 127 / 2048) * step + 1e-8).all() and not torch.equal(got, want)


def test_refinement_gain_is_one_for_clean_codes_and_falls_with_noise_and_truncation(tiny_calib):
    """γ = S / (S + E‖eM‖²): 1 for clean full-rank codes; less as the codes get noisier or shorter."""
    layer = tiny_calib.stats["joint_layers"][0]
    k, v = tiny_calib.key_codes[layer], tiny_calib.value_codes[layer]
    zeros = (torch.zeros(k.max_rank), torch.zeros(v.max_rank))
    assert tiny_calib.refine_gain(layer, zeros) == 1.0
    rows = tiny_calib.stats["fit_rows_per_layer"]
    gains = [tiny_calib.refine_gain(layer, (torch.full((k.max_rank,), f * float(k.spectrum[0]) ** 2 / rows),
                                            torch.full((v.max_rank,), f * float(v.spectrum[0]) ** 2 / rows)))
             for f in (1e-6, 1e-4, 1e-2, 1e6)]
    assert all(a > b for a, b in zip(gains, gains[1:])) and 0 < gains[-1]
    # no sent channel's error exceeds its variance: very coarse codes are as noisy as sending nothing at all
    assert gains[-1] == pytest.approx(tiny_calib.refine_gain(layer, (torch.zeros(0), torch.zeros(0))))
    shorter = [tiny_calib.refine_gain(layer, (torch.zeros(r), torch.zeros(v.max_rank)))
               for r in (k.max_rank, k.max_rank // 2, 1)]
    assert shorter[0] == 1.0 and shorter[0] > shorter[1] > shorter[2]
    # by hand, for one case: S / (S + Σ_c var_c ‖d_c M‖²)
    code = tiny_calib.joint[layer]
    m = torch.block_diag(k.dec.double(), v.dec.double()) @ code.enc.double() @ code.dec.double()
    var = torch.cat([torch.zeros(1), k.spectrum[1:].double() ** 2 / rows, torch.zeros(v.max_rank, dtype=torch.float64)])
    s_energy = float((code.spectrum.double() ** 2).sum()) / rows
    want = s_energy / (s_energy + float((var * (m**2).sum(1)).sum()))
    assert tiny_calib.refine_gain(layer, (torch.zeros(1), torch.zeros(v.max_rank))) == pytest.approx(want)


def test_the_folded_receive_map_is_decode_refine_and_correct_in_turn(tiny_pair, tiny_calib):
    """``Calibration.decoded`` (what ``receive`` runs with a calibration's own corrections) equals decoding the codes,
    refining them with the noise-weighed gain and applying the trained correction one step after another: at full
    rank and truncated, int4-noisy and clean, with and without a correction; a nonlinear correction takes the steps.
    ``receive`` through it gives the cache the steps give (corrections passed explicitly take the steps)."""
    layer = tiny_calib.stats["joint_layers"][0]
    k, v = tiny_calib.key_codes[layer], tiny_calib.value_codes[layer]
    g = torch.Generator().manual_seed(3)
    d = k.dec.shape[1] + v.dec.shape[1]
    linear = {"a": torch.randn(d, 3, generator=g), "b": 0.2 * torch.randn(3, d, generator=g),
              "s": 0.1 * torch.randn(d, generator=g), "sigma": torch.rand(d, generator=g) + 0.5,
              "tau": torch.rand(d, generator=g) + 0.5}
    gated = linear | {"g": torch.randn(d, 2, generator=g), "u": torch.randn(d, 2, generator=g),
                      "w": 0.1 * torch.randn(2, d, generator=g)}
    cpu = torch.device("cpu")
    for corrections in (None, {layer: linear}, {layer: gated}):
        calib = dataclasses.replace(tiny_calib, corrections=corrections)
        for rk, rv, noisy in ((k.max_rank, v.max_rank, False), (k.max_rank // 2, v.max_rank - 1, True)):
            zk, zv = torch.randn(7, rk, generator=g), torch.randn(7, rv, generator=g)
            noise = (torch.full((rk,), 0.3 if noisy else 0.0), torch.full((rv,), 0.3 if noisy else 0.0))
            steps = calib.correct(layer, *calib.refine(layer, k.decode(zk), v.decode(zv), noise))
            got = calib.decoded(layer, zk, zv, noise, cpu)
            for a, b in zip(got, steps):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            assert not torch.allclose(got[1], v.decode(zv), atol=1e-3)  # the refinement and correction did act
    calib = dataclasses.replace(tiny_calib, corrections={layer: linear})
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window_ids(48, 3), 8)
    blob = transfer.build_payload(case.state, _low_rank_plan(calib), calib)
    folded = hf.cache_kv(transfer.receive(tiny_pair.consumer, blob, calib).cache)
    stepped = hf.cache_kv(transfer.receive(tiny_pair.consumer, blob, calib, calib.corrections).cache)
    for x, y in zip(folded, stepped):
        for a, b in zip(x, y):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    uncorrected = hf.cache_kv(transfer.receive(tiny_pair.consumer, blob, calib, {}).cache)
    assert not torch.allclose(folded[1][layer], uncorrected[1][layer])


def test_decoded_sections_know_their_rounding_noise():
    """The receiver's noise estimate, step²/12 per value, matches the real squared error of uniform data
    (groups of many values: their extremes, which round exactly, are few)."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(400, 6, generator=g) * torch.tensor([1.0, 2, 4, 8, 16, 32])
    sec = payload.decode(payload.encode(payload.Layout(400, 0),
                                        [payload.Section(0, "k_code", x, 4, 50, "channel")])).sections[0]
    torch.testing.assert_close(sec.noise, ((sec.data - x) ** 2).mean(0).double(), rtol=0.2, atol=0)
    # token groups: one step per row and group
    wide = torch.rand(64, 192, generator=g) * torch.linspace(1, 4, 64)[:, None]
    sec = payload.decode(payload.encode(payload.Layout(64, 0),
                                        [payload.Section(0, "k_code", wide, 3, 48, "token")])).sections[0]
    assert float(sec.noise.mean()) == pytest.approx(float(((sec.data - wide) ** 2).mean()), rel=0.15)
    tc = payload.decode(payload.encode(payload.Layout(400, 0),
                                       [payload.Section(0, "k_code", x, 0, step=0.5)])).sections[0]
    assert tc.noise.tolist() == [0.5**2 / 12] * tc.data.shape[1]
    # fp16
    assert payload.decode(payload.encode(payload.Layout(400, 0),
                                         [payload.Section(0, "k_code", x)])).sections[0].noise is None


def test_shrinkage_toward_identity_lowers_error_on_the_other_domain():
    """Fitted on few rows of one domain, the plain map overfits; some shrinkage does better on the other."""
    (xa, ya), (xb, yb) = _shifted_domains(n=30)
    a, b = rrr.RRRStats(12, 12), rrr.RRRStats(12, 12)
    a.add(xa, ya)
    b.add(xb, yb)
    errs = {s: b.heldout_error(*a.full_map(1e-3, s)) for s in (0.0, 0.1, 1.0)}
    assert min(errs[0.1], errs[1.0]) < errs[0.0]


def test_calibration_chooses_shrinkage_by_held_out_folds(tiny_calib):
    stats = tiny_calib.stats
    table = {float(k): v for k, v in stats["shrink_lodo_error"].items()}
    assert stats["shrink"] == min(table, key=table.get)
    assert set(table) == set(tiny_calib.config.shrink_grid) and stats["domains"] == ["texts"]
    for layer in stats["identity_k"]:  # an identity code at full rank is the producer's key plus a mean shift
        code = tiny_calib.key_codes[layer]
        torch.testing.assert_close(code.enc @ code.dec, torch.eye(code.enc.shape[0]), atol=1e-4, rtol=0)


def test_paired_bootstrap_intervals_are_exact_on_exact_relations():
    from scdviz import metrics

    a = [0.1, 0.4, 0.2, 0.9, 0.3]
    same = metrics.paired_bootstrap(a, a)
    assert same["diff"] == 0 and same["diff_ci"] == [0.0, 0.0] and same["ratio_ci"] == pytest.approx([1.0, 1.0])
    double = metrics.paired_bootstrap(a, [2 * x for x in a])
    assert double["ratio"] == pytest.approx(2.0) and double["ratio_ci"] == pytest.approx([2.0, 2.0])
    half = metrics.paired_bootstrap(a, [x / 2 for x in a])  # halving every item halves the ratio, exactly
    assert half["ratio"] == pytest.approx(0.5) and half["ratio_ci"] == pytest.approx([0.5, 0.5]) and half["n"] == len(a)
    noisy = metrics.paired_bootstrap(a, [x + d for x, d in zip(a, (0.5, -0.4, 0.3, -0.2, 0.1))])
    assert noisy["diff_ci"][0] < noisy["diff"] < noisy["diff_ci"][1]
    with pytest.raises(ValueError, match="equally long"):
        metrics.paired_bootstrap(a, a[:2])


def test_kivi_window_sends_the_recent_tokens_exactly(tiny_pair):
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window_ids(48, 3), 8)
    plain, kivi = plans.raw_plan(3, bits=4), plans.raw_plan(3, bits=4, window=8)
    n = case.state.ids.shape[1] - 1  # token 0 recomputed
    d = case.state.keys[0].shape[1]
    grown = len(transfer.build_payload(case.state, kivi)) - len(transfer.build_payload(case.state, plain))
    saved = sum(payload.section_len(n, d, 4, 32, ax) - payload.section_len(n - 8, d, 4, 32, ax)
                for ax in ("channel", "token"))
    # per layer: two fp16 sections, shorter int4 ones
    assert grown == 3 * (2 * (payload.SECTION.size + 8 * d * 2) - saved)
    got = transfer.receive(tiny_pair.consumer, transfer.build_payload(case.state, kivi))
    keys, values = hf.cache_kv(got.cache)
    for layer in range(3):
        sent = case.state.keys[layer][-8:].half().float()
        torch.testing.assert_close(keys[layer][0].transpose(0, 1).flatten(1)[-8:].float(), sent)


def test_context_qa_items_quote_the_prompt_and_raw_reuse_of_the_same_model_answers_like_the_oracle():
    from scdviz import qa

    same = make_pair(tiny_model("llama"), tiny_model("llama"))
    windows = [window_ids(48, s) for s in range(3)]
    cases = measure.prepare_cases(same, windows, 8, progress=False, qa_answer_len=4)
    for w, case in zip(windows, cases):
        prompt, item = w[:-8], case.qa_item
        cue = item.question[-qa.CUE:]
        starts = [i for i in range(len(prompt)) if prompt[i : i + qa.CUE] == cue]
        assert item.question[0] == prompt[-1] and item.answer == prompt[starts[0] + qa.CUE : starts[0] + qa.CUE + 4]
    oracle, _ = measure.oracle_result(same, cases, 0)
    raw = measure.run_plan_on_cases(same, cases, plans.raw_plan(3), None)
    assert len(raw.qa_f1) == 3 and raw.qa_f1 == oracle.qa_f1
    assert "qa_f1" in measure.table([oracle, raw]).columns


def test_the_qa_table_gives_each_methods_share_of_the_oracles_f1_paired_over_passages():
    """``of_oracle`` is the ratio of pooled means, method over oracle, with a paired passage-bootstrap interval;
    the oracle keeps 1; with an oracle that answers nothing the share is left empty, not divided by 0."""
    from types import SimpleNamespace as NS

    from scdviz import metrics, protocol
    from scdviz.scd import bench

    budget = "SCD transform-coded @3840 B/token"  # a budget row: the issue's "SCD at <= 3,840 B/token" reads it

    def report(f1: dict, passages: list[str]):
        rows = [NS(method=m, qa_f1=v, group="budget sweep" if m == budget else "method") for m, v in f1.items()]
        return NS(methods=[r for r in rows if r.group == "method"], passages=passages,
                  sweeps=[r for r in rows if r.group != "method"] + [NS(method="SCD k=1", qa_f1=[0.0], group="patch")])

    one = {"oracle": [0.5, 1.0, 0.25, 0.75], "raw KV": [0.0, 0.5, 0.25, 0.25], "SCD full": [0.5, 0.75, 0.0, 0.5],
           budget: [0.25, 1.0, 0.25, 0.5]}
    two = {"oracle": [1.0, 0.5], "raw KV": [0.5, 0.0], "SCD full": [1.0, 0.25], budget: [0.5, 0.5]}
    reports = [report(one, ["a", "a", "b", "c"]), report(two, ["d", "d"])]
    got = bench.qa_table(reports).set_index("method")
    pooled = {m: one[m] + two[m] for m in one}
    assert list(got.index) == ["oracle", "raw KV", "SCD full", budget]  # other sweep groups are not QA rows
    assert got.loc["oracle", "of_oracle"] == 1.0
    for m in ("raw KV", "SCD full", budget):
        assert got.loc[m, "of_oracle"] == pytest.approx(sum(pooled[m]) / sum(pooled["oracle"]), abs=1e-3)
        boot = metrics.paired_bootstrap(pooled["oracle"], pooled[m], clusters=["a", "a", "b", "c", "d", "d"])
        assert got.loc[m, "of_oracle_ci95"] == protocol.interval(boot["ratio_ci"])
    none = bench.qa_table([report({m: [0.0, 0.0] if m == "oracle" else v[:2] for m, v in two.items()}, ["d", "d"])])
    assert none["of_oracle"].isna().all() and (none["items"] == 2).all()


def test_leave_one_domain_out_bench_measures_each_domain_with_a_calibration_that_never_saw_it(tiny_pair):
    import dataclasses

    from scdviz.scd import bench

    cfg = small_cfg(None, domains=["jargon", "bible"], n_fit=4, n_select=2)
    calib = cal.calibrate(cfg, tiny_pair, progress=False)
    assert calib.stats["domains"] == ["jargon", "bible"]
    run = bench.ScdBenchConfig(lodo=True, limit=2, prompt_len=40, cont_len=8, gen_tokens=0, sent_rows=False,
                               qa_answer_len=3)
    reports = bench.reports(run, tiny_pair, calib, progress=False)
    assert [r.domain for r in reports] == ["jargon", "bible"]
    assert [r.calibrated_on for r in reports] == [["bible"], ["jargon"]]
    table = bench.domain_table(reports)
    assert table["held_out"].all() and list(table["domain"]) == ["jargon", "bible"]
    assert (table["n"] == 2).all() and table["ratio_ci"].str.startswith("[").all()
    for rep, above in zip(reports, table["above_raw"]):  # prompts where SCD full is worse than raw reuse
        raw = next(r for r in rep.methods if r.method.startswith("raw KV"))
        full = next(r for r in rep.methods if r.method == "SCD full")
        assert above == sum(s > r for s, r in zip(full.kl_per_prompt, raw.kl_per_prompt)) <= 2
    qa_rows = bench.qa_table(reports)
    assert set(qa_rows["items"]) == {4} and "SCD full" in set(qa_rows["method"])
    # leave out only bible
    one = bench.reports(dataclasses.replace(run, domains=["bible"]), tiny_pair, calib, progress=False)
    assert [(r.domain, r.calibrated_on) for r in one] == [("bible", ["jargon"])]
    with pytest.raises(ValueError, match="only a domain the calibration saw"):
        bench.reports(dataclasses.replace(run, domains=["austen"]), tiny_pair, calib, progress=False)
    with pytest.raises(ValueError, match="needs a calibration of 2\\+ domains"):
        bench.reports(run, tiny_pair, cal.calibrate(small_cfg(None, domains=["bible"], n_fit=4, n_select=2), tiny_pair,
                                                progress=False), progress=False)


def test_leave_one_domain_out_trains_a_trained_stage_again_with_its_recipe_without_the_domain(tiny_pair, monkeypatch):
    """--lodo with a calibration that carries a trained correction stage: each held-out domain's calibration is
    the closed form made again without it, then the stage trained again with the loaded stage's own recipe
    (its log's config) on the remaining domains only; the bench measures it beside its closed form."""
    import dataclasses

    from scdviz.scd import bench, distil

    base = cal.calibrate(small_cfg(None, domains=["jargon", "bible"], n_fit=4, n_select=2), tiny_pair, progress=False)
    recipe = distil.DistilConfig(val_every=0,
                                 rank=2, epochs=3, train_windows=4, val_windows=1, prompt_len=40, cont_len=8,
                                 lr=1e-2, budgets=[], recall=0.0, seed=3)
    trained, _ = distil.distil(tiny_pair, base, recipe, progress=False)
    assert trained.corrections and bench.distil_recipe(trained) == recipe and bench.distil_recipe(base) is None
    seen, real = [], distil.distil

    def spy(pair, calib, cfg, progress=True, at=None, folder=None, spool=None):
        seen.append((calib.stats["domains"], calib.corrections, cfg))
        return real(pair, calib, cfg, progress, at, folder, spool)

    monkeypatch.setattr(distil, "distil", spy)
    run = bench.ScdBenchConfig(lodo=True, domains=["bible"], limit=2, prompt_len=40, cont_len=8, gen_tokens=0,
                               sent_rows=False, qa_answer_len=3)
    (report,) = bench.reports(run, tiny_pair, trained, progress=False)
    assert [(d, c, cfg) for d, c, cfg in seen] == [(["jargon"], None, recipe)]  # trained from the fold's closed form
    names = [r.method for r in report.methods]
    assert report.calibrated_on == ["jargon"] and any(n.endswith("(closed form)") for n in names)
    closed = next(r for r in report.methods if r.method == "SCD reuse-only (closed form)")
    assert next(r for r in report.methods if r.method == "SCD reuse-only").kl != closed.kl  # the stage was applied
    row = bench.domain_table([report]).iloc[0]  # raw reuse against the trained SCD full, not its closed-form twin
    full = next(r for r in report.methods if r.method == "SCD full")
    assert row["scd_kl"] == round(full.kl, 4) and report.methods[-1].method.endswith("(closed form)")
    seen.clear()
    bench.reports(run, tiny_pair, base, progress=False)  # a closed form alone is refitted as before: no training
    assert seen == []
    with pytest.raises(ValueError, match="carries no recipe"):
        bare = dataclasses.replace(trained, stats={k: v for k, v in trained.stats.items() if k != "distil"})
        bench.reports(run, tiny_pair, bare, progress=False)
    # a stage trained before --val-every existed (its log has no such key) validated after each epoch: so is its refit
    log = trained.stats["distil"]
    older = dataclasses.replace(trained, stats={**trained.stats, "distil": {
        **log, "config": {k: v for k, v in log["config"].items() if k != "val_every"}}})
    assert bench.distil_recipe(older) == recipe and distil.DistilConfig().val_every != 0


def test_leave_one_domain_out_with_a_work_folder_resumes_a_stopped_fold_and_measures_the_same(tiny_pair, tmp_path,
                                                                                               monkeypatch):
    """--lodo --work: each fold's closed form and trained stage are saved in the work folder and measured as read
    back; a run stopped inside a fold's fit and run again resumes it (its checkpoint) and measures exactly what an
    uninterrupted run does; a finished fold is read, not made again; its spool is gone once its stage is saved;
    a fold folder made with other settings is refused."""
    import dataclasses

    from scdviz.scd import bench, distil

    base = cal.calibrate(small_cfg(None, domains=["jargon", "bible"], n_fit=4, n_select=2), tiny_pair, progress=False)
    recipe = distil.DistilConfig(val_every=3, rank=2, epochs=2, train_windows=4, val_windows=1, prompt_len=40,
                                 cont_len=8, lr=1e-2, budgets=[], recall=0.0, seed=3)
    trained, _ = distil.distil(tiny_pair, base, recipe, progress=False)
    run = bench.ScdBenchConfig(lodo=True, domains=["bible"], limit=2, prompt_len=40, cont_len=8, gen_tokens=0,
                               sent_rows=False, qa_answer_len=0)

    def kls(reports):
        return {r.method: r.kl_per_prompt for rep in reports for r in rep.methods}

    whole = kls(bench.reports(dataclasses.replace(run, work=str(tmp_path / "a")), tiny_pair, trained, progress=False))
    assert not (tmp_path / "a" / "without-bible" / "distil").exists()  # the spool went once the stage was saved
    assert kls(bench.reports(run, tiny_pair, trained, progress=False)) == whole  # no folder: a temporary one

    real, calls = distil.step, []

    def stopping(*args):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt  # a stop in the middle of the fold's fit
        return real(*args)

    monkeypatch.setattr(distil, "step", stopping)
    again = dataclasses.replace(run, work=str(tmp_path / "b"))
    with pytest.raises(KeyboardInterrupt):
        bench.reports(again, tiny_pair, trained, progress=False)
    assert (tmp_path / "b" / "without-bible" / "distil" / "checkpoint.json").is_file()
    assert kls(bench.reports(again, tiny_pair, trained, progress=False)) == whole  # resumed, not begun again
    made = []
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: made.append(1))
    monkeypatch.setattr(distil, "distil", lambda *a, **k: made.append(1))
    assert kls(bench.reports(again, tiny_pair, trained, progress=False)) == whole and made == []  # read back
    other = dataclasses.replace(trained, config=dataclasses.replace(trained.config, n_select=1))
    with pytest.raises(ValueError, match="holds a fold made with other settings"):
        bench.reports(again, tiny_pair, other, progress=False)
    with pytest.raises(ValueError, match="give it with --lodo"):
        bench.reports(dataclasses.replace(again, lodo=False), tiny_pair, trained, progress=False)


def test_lineup_names_are_unique_even_when_no_patch_survives(tiny_calib):
    import dataclasses

    gated = dataclasses.replace(tiny_calib, patch_order=[])
    for sink in ("recompute", "send"):
        names = [p.name for p in plans.lineup(gated, sink=sink)]
        assert len(set(names)) == 5 and names[-1].startswith("SCD full") and names[-2].startswith("SCD reuse-only")


def test_linear_aligner_recovers_an_exact_linear_relation_in_kv_space_and_shrinks_to_identity():
    from scdviz.scd.patch import fit_patch, fit_patches, linear_corrections

    g = torch.Generator().manual_seed(0)
    d, d_out, n = 24, 10, 400
    h_p = torch.randn(n, d, generator=g) * torch.linspace(0.5, 3, d) + 1.0
    true = torch.eye(d) + 0.3 * torch.randn(d, d, generator=g)
    h_c = h_p @ true + 0.5
    weight = torch.randn(d_out, d, generator=g)  # consumer k/v projection
    exact = fit_patch(0, h_p, h_c, weight, shrink=0.0, ridge=1e-9)
    assert exact.fit_err < 1e-8  # the K, V it regenerates equal the consumer's
    identity = fit_patch(0, h_p, h_c, weight, shrink=float("inf"))
    assert torch.count_nonzero(identity.aligner.lin.weight) == 0
    shrinks = [0.0, 0.1, 1.0, 10.0, float("inf")]
    errs = [fit_patch(0, h_p, h_c, weight, shrink=a).fit_err for a in shrinks]
    assert errs == [p.fit_err for p in fit_patches(0, h_p, h_c, weight, shrinks=shrinks)]  # one shared fit, same result
    assert errs == sorted(errs) and errs[-1] > 10 * errs[1]  # shrinking costs fit error, monotonically
    # Directions the projection ignores get no correction: Δ maps into the row space of P Pᵀ only.
    zp = (h_p - h_p.mean(0)) / h_p.std(0)
    delta, _ = linear_corrections(zp, zp @ true, weight.T, [0.0])[0]
    null = torch.linalg.svd(weight)[2][d_out:].T  # (d, d - d_out) null space of the projection
    assert float((delta @ null).abs().max()) < 1e-4 * float(delta.abs().max())


def test_patch_table_gives_each_k_relative_to_reuse_only_on_the_same_prompts(tiny_pair, texts):
    from scdviz.scd import bench

    calib = cal.calibrate(small_cfg(texts, given=[0, 2], patch_k=2), tiny_pair, progress=False)
    run = bench.ScdBenchConfig(texts=texts, limit=3, prompt_len=40, cont_len=8, gen_tokens=0, sent_rows=False,
                               qa_answer_len=0, sweeps=True)
    reports = bench.reports(run, tiny_pair, calib, progress=False)
    table = bench.patch_table(reports)
    given = table[table["placement"] == "given"]
    assert (list(given["k"]) == [0, 1, 2] and given["vs_k0"].iloc[0] == 1.0
            and given["vs_k0_ci95"].iloc[0] == "[1.000, 1.000]")
    sweep = {r.method: r for r in reports[0].sweeps if r.group == "patch sweep"}
    assert given["kl"].iloc[2] == round(sweep["SCD k=2 (given)"].kl, 4)
    assert given["vs_k0"].iloc[2] == round(sweep["SCD k=2 (given)"].kl / sweep["SCD k=0 (given)"].kl, 3)


def test_every_candidate_patch_records_its_held_out_choice_and_only_kept_patches_are_placed(tiny_calib):
    from scdviz.app import scd

    gates = tiny_calib.stats["patch_gate"]
    assert set(map(int, gates)) == set(tiny_calib.patches)  # every aligner went through the same held-out choice
    for g in gates.values():
        linear = g["lodo_sse"]["identity" if g["shrink"] == "identity" else str(g["shrink"])]
        assert linear == min(g["lodo_sse"].values())  # the shrinkage chosen is the held-out best
        assert g["patch_sse"] == linear and "mlp" not in g  # a linear aligner only
        assert g["kept"] == (g["patch_sse"] < g["code_sse"])
    assert set(tiny_calib.patch_order) <= {int(k) for k, g in gates.items() if g["kept"]}
    assert "Aligners: identity + a linear correction" in scd.calibration_summary(tiny_calib)
    assert "Correction stage" not in scd.calibration_summary(tiny_calib)  # the closed form says nothing of one
    log = {"val_kl": [0.2, 0.15, 0.12], "best_epoch": 2, "train_windows": 6, "config": {"rank": 4}}
    trained = dataclasses.replace(tiny_calib, corrections={0: {}, 1: {}}, stats={**tiny_calib.stats, "distil": log})
    line = scd.calibration_summary(trained)
    assert "trained through the consumer on 2 layers (rank 4, 6 training windows; validation 0.2000 → 0.1200)" in line


def test_greedy_selection_kl_equals_running_the_selected_plans_end_to_end(tiny_pair, texts):
    calib = cal.calibrate(small_cfg(texts, gate_patches=False, n_candidates=3, patch_k=3), tiny_pair, progress=False)
    windows = calibration.windows(tiny_pair, calib.config)[2]
    cases = [transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, w, calib.config.cont_len) for w in windows]
    assert len(calib.patch_order) == 3
    for k, want in enumerate(calib.selection_kl):
        plan = plans.full_rank_plan(calib, calib.patch_order[:k])
        runs = [transfer.run_plan(tiny_pair.consumer, case, plan, calib) for case in cases]
        got = sum(float(metrics.kl_per_token(c.oracle_logits, r.logits).mean())
                  for c, r in zip(cases, runs)) / len(cases)
        assert abs(got - want) < 1e-5 * max(1.0, want)


def test_a_builtin_specialist_is_benched_on_the_corpus_it_was_trained_on(tiny_calib):
    from scdviz.models import builtin
    from scdviz.scd import bench

    cfg = bench.ScdBenchConfig()
    for name in builtin.specialists():
        assert bench.eval_domains(cfg, name, tiny_calib) == [builtin.training_corpus(name)]
    assert bench.eval_domains(cfg, "tiny:c", tiny_calib) == ["texts"]  # unknown: every calibration domain
    assert builtin.training_corpus("austen-before") == "austen" and builtin.training_corpus("../austen") is None


# ----------------------------------------------------------------------------- rate–distortion planner


@pytest.fixture(scope="module")
def tiny_curves(tiny_pair, tiny_calib):
    from scdviz.scd import rate

    return rate.measure(tiny_pair, tiny_calib, n_windows=2, progress=False)


def test_error_by_rank_equals_decoding_every_rank():
    from scdviz.scd import rate

    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(30, 12, generator=g) for _ in range(2)]
    mix = torch.randn(12, 12, generator=g)
    ys = [x @ mix + 0.1 * torch.randn(30, 12, generator=g) for x in xs]
    code = fit_rrr(torch.cat(xs), torch.cat(ys))
    for bits in (3, 16):
        curve = rate.error_by_rank(code, xs, ys, bits, 8)
        for r in (0, 1, 5, 12):
            direct = sum(float(((code.decode(rate.quantised(code.encode(x, r), bits, 8)) - y).double() ** 2).sum())
                         for x, y in zip(xs, ys))
            assert curve[r].item() == pytest.approx(direct, rel=1e-6)
    exact = rate.error_by_rank(code, xs, ys, 16, 8)
    assert float(exact[12]) < float(exact[6]) < float(exact[0])  # more rank, less error (fp16 codes)


def test_rd_plan_is_a_hard_byte_limit_on_the_real_payload(tiny_pair, tiny_calib, tiny_curves):
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window_ids(60), 8)
    n_tokens = case.state.ids.shape[1]
    predicted = []
    for budget in (12.0, 20.0, 35.0, 60.0, 200.0):
        plan, info = plans.rd_plan(tiny_curves, budget, n_tokens)
        blob = transfer.build_payload(case.state, plan, tiny_calib)
        assert len(blob) / n_tokens <= budget  # headers and scales included
        assert len(blob) / n_tokens == pytest.approx(info["bytes_per_token"])  # the planner counts real bytes
        assert budget - len(blob) / n_tokens < 2.0 or budget == 200.0  # and uses what it is given
        transfer.receive(tiny_pair.consumer, blob, tiny_calib)  # and the consumer can build its cache
        predicted.append(info["predicted_kl"])
    assert predicted == sorted(predicted, reverse=True)  # more bytes, never a worse predicted KL
    with pytest.raises(ValueError, match="below the smallest SCD payload"):
        plans.rd_plan(tiny_curves, 1.0, n_tokens)


def test_rd_plan_spends_bytes_where_the_measured_sensitivity_is(tiny_curves):
    import dataclasses

    loud = dataclasses.replace(tiny_curves, sens_k=tiny_curves.sens_k.clone(), sens_v=tiny_curves.sens_v.clone())
    loud.sens_k[1] *= 1000  # layer 1's keys matter far more
    quiet = dataclasses.replace(tiny_curves, sens_k=tiny_curves.sens_k.clone(), sens_v=tiny_curves.sens_v.clone())
    quiet.sens_k[1] /= 1000
    a, _ = plans.rd_plan(loud, 30.0, 47)
    b, _ = plans.rd_plan(quiet, 30.0, 47)
    key_bytes = lambda p: p.rank_k[1] * p.bits_k[1] if p.modes[1] == "code" else 1e9  # noqa: E731
    assert key_bytes(a) > key_bytes(b)


def test_ttft_table_counts_every_step_and_break_even_follows_from_it(tiny_pair, tiny_calib):
    from scdviz.scd import ttft

    samples = {("producer prefill", "prefill"): [0.2, 0.4, 0.3], ("oracle", "prefill"): [0.5, 0.5, 0.5],
               ("oracle", "first_step"): [0.1, 0.1, 0.1]}
    for name, enc, rec in (("fast", 0.01, 0.05), ("slow", 0.7, 0.05), ("fast" + plans.CLOSED, 0.01, 0.04)):
        samples |= {(name, "encode"): [enc] * 3, (name, "receive"): [rec] * 3, (name, "first_step"): [0.04] * 3}
    names = ["fast", "slow", "fast" + plans.CLOSED]
    table = ttft.timing_table(samples, {n: b for n, b in zip(names, (1000.0, 10.0, 1000.0))}, names, 4, 3, 100)
    fast, slow = table.iloc[1], table.iloc[2]
    assert fast["receive_vs_closed_form"] == 1.25  # 50 ms against its closed-form twin's 40 ms
    assert table["receive_vs_closed_form"].iloc[2:].isna().all()  # no twin: nothing to compare
    assert table["oracle_ms"].iloc[0] == 600.0 and fast["producer_prefill_ms"] == 300.0
    compute = 0.01 + 0.05 + 0.04
    assert fast["ttft_10gbps_ms"] == round(1000 * (compute + 1000 * 100 * 8 / 10e9), 1)
    assert fast["ttft_with_prefill_10gbps_ms"] == round(1000 * (compute + 0.3 + 1000 * 100 * 8 / 10e9), 1)
    assert fast["ttft_shared4_10gbps_ms"] == round(1000 * (compute + 0.3 / 4 + 1000 * 100 * 8 / 10e9), 1)
    assert fast["break_even_gbps"] == round(1000 * 100 * 8 / (0.6 - compute) / 1e9, 3)
    assert slow["break_even_gbps"] is None or pd.isna(slow["break_even_gbps"])  # compute alone slower than the oracle
    cfg = ttft.TtftConfig(limit=1, prompt_len=40, reps=2, budget=30.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ttft.data, "load_split", lambda domain, split: ["the quick brown fox " * 30])
        mp.setattr(ttft.builtin, "training_corpus", lambda name: "jargon")
        live = ttft.run(cfg, tiny_pair, tiny_calib, progress=False)
    assert list(live["method"])[:1] == ["oracle"] and "SCD RD+entropy @30 B/token" in set(live["method"])
    assert (live["bytes_per_token"].iloc[1:] > 0).all() and live["timings_per_step"].iloc[0] == 2


def test_scale_timing_adds_up_its_steps_and_scales_the_link_with_bytes():
    from scdviz.scd import scale

    (row,) = scale.Timing("tiny", (32,), "cpu", torch.float32, reps=1, warmup=0).rows()
    parts = row["token0_ms"] + row["codes_ms"] + row["patches_ms"] + row["parse_cpu_ms"]
    assert row["scd_consumer_ms"] == pytest.approx(parts, abs=0.01)
    hidden, layers, heads, kv, hd, ffn, vocab = scale.SHAPES["tiny"]
    assert row["payload_mb"] == pytest.approx(2 * layers * kv * hd * 2 * 32 / 6 / 1e6, abs=1e-3)
    wire_1 = row["scd_ttft_1gbps_ms"] - row["scd_consumer_ms"]
    wire_10 = row["scd_ttft_10gbps_ms"] - row["scd_consumer_ms"]
    assert wire_1 == pytest.approx(10 * wire_10, rel=0.05, abs=0.002)


# ----------------------------------------------------------------------------- the trained correction stage


def _low_rank_plan(calib):
    from scdviz.scd import plan as plans

    n = len(calib.key_codes)
    return plans.scd_plan([2] * n, [2] * n, [], code_bits=16, name="rank 2")


def test_a_correction_starts_as_the_identity_and_survives_save_and_load(tiny_pair, tiny_calib, tmp_path,
                                                                         monkeypatch):
    """b = s = 0 leaves every received cache bit for bit as the closed form's; a trained one changes it,
    is written with the calibration and read back exactly, and gives the calibration another tag."""
    from scdviz.scd import distil

    plan = _low_rank_plan(tiny_calib)
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window_ids(), 8)
    blob = transfer.build_payload(case.state, plan, tiny_calib)
    start = distil.initial(distil.row_spread(tiny_calib, [blob]), 3, 0)
    assert sorted(start) == [i for i, m in enumerate(plan.modes) if m == "code"]
    plain = hf.cache_kv(transfer.receive(tiny_pair.consumer, blob, tiny_calib, {}).cache)  # the steps, none corrected
    same = hf.cache_kv(transfer.receive(tiny_pair.consumer, blob, tiny_calib, start).cache)
    assert all(torch.equal(a, b) for x, y in zip(plain, same) for a, b in zip(x, y))
    g = torch.Generator().manual_seed(1)
    trained = {layer: p | {"b": 0.1 * torch.randn(p["b"].shape, generator=g), "s": torch.full_like(p["s"], 0.05)}
               for layer, p in start.items()}
    with_it = copy.copy(tiny_calib)
    with_it.corrections, with_it.stats = trained, {**tiny_calib.stats, "distil": {"note": "by hand"}}
    with_it.__dict__.pop("tag", None)
    with pytest.raises(ValueError, match="use the sender's calibration"):  # the two never mix
        transfer.receive(tiny_pair.consumer, blob, with_it)
    mine = transfer.build_payload(case.state, plan, with_it)
    moved = hf.cache_kv(transfer.receive(tiny_pair.consumer, mine, with_it).cache)
    layer = next(iter(trained))
    assert not torch.allclose(moved[0][layer], plain[0][layer])
    with_it.save(tmp_path)
    back = calibration.Calibration.load(tmp_path)
    assert back.tag == with_it.tag != tiny_calib.tag
    kept = calibration.stored(trained)  # the factors a, b go through int8 rows, the rest is float32
    assert all(torch.equal(back.corrections[i][n], kept[i][n]) for i in trained for n in trained[i])
    assert all(torch.equal(kept[i][n], trained[i][n]) for i in trained for n in ("s", "sigma", "tau"))
    for i in trained:  # int8 rows: each entry within half a step (absmax / 127) of the trained one, plus the
        for n in set(calibration.CORRECTION_FACTORS) & set(trained[i]):  # fp16 scale's rounding (2^-11) x 127 steps
            step = trained[i][n].abs().amax(1, keepdim=True) / 127
            assert ((kept[i][n] - trained[i][n]).abs() <= (0.5 + 127 / 2048) * step + 1e-8).all()
    assert all(torch.equal(calibration.stored(kept)[i][n], kept[i][n]) for i in kept for n in kept[i])  # a fixed point
    old = tmp_path / "format3"  # format 3 held the factors in float32: its files read as they were written
    art = artefact.load(tmp_path / calibration.FILE, calibration.KIND)
    assert art.version == 4 and art.tensors[f"c.{layer}.a"].dtype == torch.int8
    assert f"c.{layer}.tau" not in art.tensors  # equal to sigma (as distil makes it): not stored twice
    tensors = {k: v for k, v in art.tensors.items() if not (k.startswith("c.") and k.endswith("_scale"))}
    tensors |= {f"c.{i}.{n}": trained[i][n] for i in trained for n in ("a", "b", "tau")}  # format 3: no MLP
    monkeypatch.setitem(artefact.VERSIONS, calibration.KIND, 3)
    artefact.save(old / calibration.FILE, calibration.KIND, tensors, art.identity, art.config, art.meta)
    monkeypatch.undo()
    from_3 = calibration.Calibration.load(old)
    assert from_3.tag == with_it.tag
    assert all(torch.equal(from_3.corrections[i][n], trained[i][n]) for i in trained for n in trained[i])
    untimed = copy.copy(with_it)  # a stage from before tau (scale 1), saved again: its tau of 1 is kept
    untimed.corrections = {i: {n: t for n, t in p.items() if n != "tau"} for i, p in trained.items()}
    untimed.save(tmp_path / "no-tau")
    ones = calibration.Calibration.load(tmp_path / "no-tau").corrections
    assert all(torch.equal(ones[i]["tau"], torch.ones_like(trained[i]["sigma"])) for i in trained)
    again = hf.cache_kv(transfer.receive(tiny_pair.consumer, mine, back).cache)  # the codes are stored in int8
    for x, y in zip(moved, again):
        for a, b in zip(x, y):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=5e-3)


def test_distilling_through_the_consumer_lowers_validation_kl_below_the_closed_form(tiny_pair, tiny_calib):
    """Trained on KL(oracle ‖ method) through the frozen consumer: the chosen epoch's validation KL is the
    log's lowest and below the closed form's, the shipped corrections give exactly that KL, and no
    gradient lands on the (shared) consumer."""
    from scdviz.scd import distil

    plan = _low_rank_plan(tiny_calib)
    cfg = distil.DistilConfig(val_every=0,
                              rank=4, epochs=5, train_windows=4, val_windows=2, prompt_len=40, cont_len=8, lr=1e-2)
    out, log = distil.distil(tiny_pair, tiny_calib, cfg, progress=False, at=[plan])
    assert len(log["val_kl"]) == cfg.epochs + 1 and len(log["train_kl"]) == cfg.epochs
    assert log["best_epoch"] > 0 and log["val_kl"][log["best_epoch"]] == min(log["val_kl"])
    assert min(log["val_kl"]) < 0.8 * log["val_kl"][0]
    assert log["train_kl"][-1] < log["train_kl"][0]
    assert all(p.grad is None for p in tiny_pair.consumer.parameters())
    train_w, val_w = distil.windows(tiny_pair, tiny_calib, cfg)
    assert not {tuple(w) for w in train_w} & {tuple(w) for w in val_w}
    cases = [transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, w, cfg.cont_len) for w in val_w]
    blobs = [transfer.build_payload(c.state, plan, out) for c in cases]
    with torch.no_grad():  # the steps (as validation ran them), then the folded map receive runs by default
        kl, folded = (sum(float(distil.continuation_kl(tiny_pair, distil.Target.of(c), b, out, how, False))
                          for c, b in zip(cases, blobs)) / len(cases) for how in (out.corrections, None))
    assert kl == pytest.approx(min(log["val_kl"]), rel=1e-5)
    assert folded == pytest.approx(kl, rel=1e-3)  # the same map, rounded in another order (KL here ~1e-4)


def _validation_kl(pair, calib, cfg, plan, trained) -> float:
    """Mean KL over distil's validation windows of ``plan`` sent with ``trained`` (recomputed from scratch, its
    corrections applied step by step as validation applies them)."""
    from scdviz.scd import distil

    _, val_w = distil.windows(pair, calib, cfg)
    cases = [transfer.prepare_case(pair.producer, pair.consumer, w, cfg.cont_len) for w in val_w]
    with torch.no_grad():
        blobs = [transfer.build_payload(c.state, plan, trained) for c in cases]
        return sum(float(distil.continuation_kl(pair, distil.Target.of(c), b, trained, trained.corrections or {},
                                                False)) for c, b in zip(cases, blobs)) / len(cases)


def test_one_correction_is_trained_and_chosen_at_every_operating_point(tiny_pair, tiny_calib):
    """Trained at two plans in turn (two quantisations of the same codes): the log keeps each plan's
    validation KL, the epoch kept minimises their mean, and the kept corrections reproduce each plan's
    KL exactly. Transform-coded plans need rate curves: asked for without them, the message says so."""
    from scdviz.scd import distil
    from scdviz.scd import plan as plans

    n = len(tiny_calib.key_codes)
    at = [plans.scd_plan([2] * n, [2] * n, [], code_bits=bits, name=f"rank 2, {bits} bits") for bits in (16, 4)]
    cfg = distil.DistilConfig(val_every=0,
                              rank=4, epochs=3, train_windows=4, val_windows=2, prompt_len=40, cont_len=8, lr=1e-2,
                              budgets=[])
    out, log = distil.distil(tiny_pair, tiny_calib, cfg, progress=False, at=at)
    by = log["val_kl_by_plan"]
    assert list(by) == [p.name for p in at] and all(len(v) == cfg.epochs + 1 for v in by.values())
    assert log["val_kl"] == pytest.approx([(a + b) / 2 for a, b in zip(*by.values())], rel=1e-12)
    assert log["best_epoch"] > 0 and log["val_kl"][log["best_epoch"]] == min(log["val_kl"])
    for p in at:
        assert _validation_kl(tiny_pair, tiny_calib, cfg, p, out) == pytest.approx(by[p.name][log["best_epoch"]],
                                                                                  rel=1e-5)
    assert [p.name for p in distil.trained_plans(tiny_calib, cfg)] == [plans.operating_plan(tiny_calib).name]
    if tiny_calib.rate is None:
        with pytest.raises(ValueError, match="rate curves"):
            distil.trained_plans(tiny_calib, distil.DistilConfig(budgets=[3840.0]))


def test_a_correction_trained_with_a_recomputed_tail_lowers_that_plans_kl(tiny_pair, tiny_calib):
    """A plan with the consumer recomputing its last prompt tokens (``plans.with_tail``, as the tail sweep
    measures a trained calibration) trains like any other: its validation KL falls below its closed form's,
    and the kept corrections reproduce it when a payload of that plan is received again (the tail's tokens
    are not sent, the correction still reaches the rest)."""
    from scdviz.scd import distil
    from scdviz.scd import plan as plans

    cfg = distil.DistilConfig(val_every=0,
                              rank=4, epochs=3, train_windows=4, val_windows=2, prompt_len=40, cont_len=8, lr=1e-2,
                              budgets=[])
    tail = plans.with_tail(plans.operating_plan(tiny_calib), 8)
    assert tail.name == plans.operating_plan(tiny_calib).name + " + last 8 recomputed" and tail.tail == 8
    out, log = distil.distil(tiny_pair, tiny_calib, cfg, progress=False, at=[tail])
    by = log["val_kl_by_plan"][tail.name]
    assert log["best_epoch"] > 0 and by[log["best_epoch"]] < by[0]
    assert _validation_kl(tiny_pair, tiny_calib, cfg, tail, out) == pytest.approx(by[log["best_epoch"]], rel=1e-5)
    assert _validation_kl(tiny_pair, tiny_calib, cfg, tail, tiny_calib) == pytest.approx(by[0], rel=1e-5)


def test_a_trained_calibration_is_benched_beside_its_closed_form(tiny_pair, tiny_calib):
    """With a correction stage, every SCD plan runs twice on the same prompts: with the correction, and as
    "(closed form)", whose numbers equal a bench of the calibration before training exactly. The closed
    form is the untrained calibration again (its tag), and raw KV, which sends no codes, runs once."""
    from scdviz.scd import bench, distil

    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window_ids(), 8)
    blob = transfer.build_payload(case.state, plans.operating_plan(tiny_calib), tiny_calib)
    start = distil.initial(distil.row_spread(tiny_calib, [blob]), 3, 0)
    g = torch.Generator().manual_seed(2)
    trained = copy.copy(tiny_calib)
    trained.corrections = {layer: p | {"b": 0.2 * torch.randn(p["b"].shape, generator=g)} for layer, p in start.items()}
    trained.stats = {**tiny_calib.stats, "distil": {"note": "by hand"}}
    trained.__dict__.pop("tag", None)
    fresh = copy.copy(tiny_calib)
    fresh.__dict__.pop("tag", None)
    assert tiny_calib.tag == fresh.tag  # calibrate names the calibration after its final stats (rate included)
    assert trained.closed_form().tag == tiny_calib.tag != trained.tag and tiny_calib.closed_form() is tiny_calib
    cfg = bench.ScdBenchConfig(cont_len=8, gen_tokens=0, sent_rows=False, qa_answer_len=0, tails=[4])
    torch.manual_seed(0)
    got = bench.bench(tiny_pair, trained, [window_ids(48, 7)], cfg, progress=False)
    both = {r.method: r for r in got.methods + got.sweeps}
    torch.manual_seed(0)
    got = bench.bench(tiny_pair, tiny_calib, [window_ids(48, 7)], cfg, progress=False)
    before = {r.method: r for r in got.methods + got.sweeps}
    assert "SCD reuse-only + last 4 recomputed" in before  # the tail sweep's SCD rows have their twins too
    assert set(both) == set(before) | {m + plans.CLOSED for m in before if m.startswith("SCD")}
    assert plans.base_name("SCD reuse-only + last 4 recomputed" + plans.CLOSED) == "SCD reuse-only" + plans.CLOSED
    for m in (m for m in before if m.startswith("SCD")):
        assert both[m + plans.CLOSED].kl_per_prompt == before[m].kl_per_prompt
        assert both[m].kl_per_prompt != before[m].kl_per_prompt  # the correction changed what the consumer got
    assert both["raw KV"].kl_per_prompt == before["raw KV"].kl_per_prompt
    from scdviz.scd import ttft  # timed the same way: each twin interleaved with its trained plan, its ratio beside

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ttft.data, "load_split", lambda domain, split: ["the quick brown fox " * 30])
        mp.setattr(ttft.builtin, "training_corpus", lambda name: "jargon")
        live = ttft.run(ttft.TtftConfig(limit=1, prompt_len=40, reps=1, budget=30.0), tiny_pair, trained, False)
    timed = live.set_index("method")["receive_vs_closed_form"]
    scd = [m for m in timed.index if m.startswith("SCD") and not m.endswith(plans.CLOSED)]
    assert scd and all(m + plans.CLOSED in timed.index and timed[m] > 0 for m in scd)
    assert pd.isna(timed["raw KV"])


def test_a_step_leaves_a_correction_its_plan_does_not_reach_exactly_as_it_was():
    """A parameter the loss does not reach (a layer the step's plan patches) is not decayed or moved by
    momentum: AdamW sees no gradient, not a zero one; the clip norm is over the gradients that exist."""
    from scdviz.scd import distil

    g = torch.Generator().manual_seed(0)
    used, unused = (torch.randn(4, 3, generator=g).requires_grad_() for _ in range(2))
    before = unused.detach().clone()
    opt_ = torch.optim.AdamW([used, unused], lr=0.1, weight_decay=0.5)
    for _ in range(2):
        first = used.detach().clone()
        loss = (3 * used).sum()  # gradient 3 everywhere: norm 3 * sqrt(12)
        assert distil.step(opt_, [used, unused], loss, clip=1.0) == pytest.approx(3 * 12**0.5)
        assert torch.equal(unused, before) and not torch.equal(used, first)


def test_one_correction_serves_a_plan_that_patches_a_layer_another_codes(tiny_pair, tiny_calib):
    """Trained at a plan that patches layer 1 and one that codes every layer: layer 1's correction is
    trained by the second alone, the kept corrections cover every layer either plan codes, and each
    plan's logged validation KL is what they give it."""
    from scdviz.scd import distil
    from scdviz.scd import plan as plans

    n = len(tiny_calib.key_codes)
    at = [plans.scd_plan([2] * n, [2] * n, [1], code_bits=16, name="patch 1"),
          plans.scd_plan([2] * n, [2] * n, [], code_bits=16, name="all code")]
    cfg = distil.DistilConfig(val_every=0,
                              rank=4, epochs=3, train_windows=4, val_windows=2, prompt_len=40, cont_len=8, lr=1e-2,
                              budgets=[])
    out, log = distil.distil(tiny_pair, tiny_calib, cfg, progress=False, at=at)
    assert log["best_epoch"] > 0 and sorted(out.corrections) == list(range(n))
    for p in at:
        assert _validation_kl(tiny_pair, tiny_calib, cfg, p, out) == pytest.approx(
            log["val_kl_by_plan"][p.name][log["best_epoch"]], rel=1e-5)


def test_a_correction_stage_footprint_is_counted_by_hand():
    """Two layers of D = 8 at rank 3, per layer: a (8 x 3) and b (3 x 8) as int8 with an fp16 scale per row
    (24 + 2*8, 24 + 2*3 bytes), s, sigma float32 (2 x 8 x 4 bytes; tau = sigma is not stored); per token and layer,
    2D (scale) + D (divide by sigma) + 2*D*r + 2*r*D (the two products) + D (times tau)."""
    from scdviz.scd import distil

    got = distil.footprint(distil.initial({0: torch.ones(8), 3: torch.ones(8)}, 3, 0), consumer_params=1000, layers=4)
    assert got["layers"] == 2 and got["of_layers"] == 4
    assert got["bytes"] == 2 * (24 + 16 + 24 + 6 + 2 * 8 * 4) and got["mb"] == round(got["bytes"] / 1e6, 3)
    assert got["flops_per_token"] == 2 * (16 + 8 + 48 + 48 + 8) and got["of_prefill"] == round(256 / 2000, 5)


def test_a_correction_is_the_linear_one_by_hand():
    """``corrected``: x (1 + s) + ((x / sigma) a b) tau, computed here by hand; with b = s = 0, as training
    starts, it is x itself."""
    gen = torch.Generator().manual_seed(0)
    x, d, r = torch.randn(5, 6, generator=gen), 6, 2
    shapes = {"a": (d, r), "b": (r, d), "s": (d,)}
    p = {k: torch.randn(*shape, generator=gen) for k, shape in shapes.items()}
    p |= {"sigma": torch.rand(d, generator=gen) + 0.5, "tau": torch.rand(d, generator=gen) + 0.5}
    calib = calibration.Calibration.__new__(calibration.Calibration)
    linear = x * (1 + p["s"]) + ((x / p["sigma"]) @ p["a"] @ p["b"]) * p["tau"]
    torch.testing.assert_close(calib.corrected(0, x, {0: p}), linear)
    started = p | {"b": torch.zeros(r, d), "s": torch.zeros(d)}
    torch.testing.assert_close(calib.corrected(0, x, {0: started}), x)


def test_recall_windows_continue_with_a_quote_of_their_own_prompt(tiny_pair, tiny_calib):
    """``recall`` of each domain's windows (spread evenly) continue with the context-QA lead and a span of
    their own prompt; the others are the plain windows, unchanged; a continuation too short to quote is refused."""
    from scdviz import qa
    from scdviz.scd import distil

    lead = tiny_pair.tokenizer(qa.LEAD, add_special_tokens=False)["input_ids"]
    base = dict(train_windows=4, val_windows=2, prompt_len=40, cont_len=len(lead) + 16)
    plain = distil.windows(tiny_pair, tiny_calib, distil.DistilConfig(**base))
    mixed = distil.windows(tiny_pair, tiny_calib, distil.DistilConfig(**base, recall=0.5))
    for per, ws, ref in ((4, mixed[0], plain[0]), (2, mixed[1], plain[1])):
        assert len(ws) == len(ref)
        for i, (w, r) in enumerate(zip(ws, ref)):
            assert len(w) == 40 + base["cont_len"] and w[:40] == r[:40]
            if i % per % 2 == 1:  # at 0.5: the first of each pair is quoted (round(n / 2) of n windows)
                assert w == r
            else:
                assert w[40 : 40 + len(lead)] == lead
                quote = w[40 + len(lead):]
                assert any(w[s : s + 16] == quote for s in range(40 - 16 + 1))
    assert [distil.is_recall(i, 0.25) for i in range(3)] == [False, True, False]  # 3 windows at 1/4: one
    assert sum(distil.is_recall(i, 0.25) for i in range(30)) == round(30 * 0.25)
    with pytest.raises(ValueError, match="recall window needs"):
        distil.windows(tiny_pair, tiny_calib, distil.DistilConfig(**{**base, "cont_len": len(lead) + 5}, recall=1.0))
    with pytest.raises(ValueError, match="share of the windows"):
        distil.DistilConfig(recall=1.5)


def test_a_backward_recall_window_asks_the_words_before_its_cue_and_answers_them_nearest_first(tiny_pair, tiny_calib):
    """With ``recall_kind='before'`` a recall window's continuation is ``qa.make_item``'s backward question about CUE
    of its own prompt's tokens, then exactly the prompt tokens before them, last one first, filling ``cont_len``;
    ``quote_from`` points at that answer; the other windows are the plain ones, unchanged."""
    from scdviz import qa
    from scdviz.scd import distil

    tok = tiny_pair.tokenizer
    head, tail = (tok(x, add_special_tokens=False)["input_ids"] for x in qa.BEFORE)
    base = dict(train_windows=4, val_windows=2, prompt_len=40, cont_len=len(head) + qa.CUE + len(tail) + 6,
                recall=0.5)
    before = distil.named_windows(tiny_pair, tiny_calib, distil.DistilConfig(**base, recall_kind="before"))
    plain = distil.named_windows(tiny_pair, tiny_calib, distil.DistilConfig(**{**base, "recall": 0.0}))
    q = distil.quote_from(tok, "before")
    assert q == len(head) + qa.CUE + len(tail) and distil.quote_from(tok) == distil.quote_from(tok, "quote")
    asked = 0
    for (name, w, recall), (name_p, w_p, _) in zip(before[0] + before[1], plain[0] + plain[1], strict=True):
        assert (name, len(w)) == (name_p, 40 + base["cont_len"]) and w[:40] == w_p[:40]
        if not recall:
            assert w == w_p
            continue
        prompt, cont = w[:40], w[40:]
        assert cont[: len(head)] == head and cont[len(head) + qa.CUE : q] == tail
        cue, answer = cont[len(head) : len(head) + qa.CUE], cont[q:]
        assert len(answer) == 6
        at = [s for s in range(6, 40 - qa.CUE + 1) if prompt[s : s + qa.CUE] == cue]
        assert any(prompt[s - 6 : s][::-1] == answer for s in at)
        asked += 1
    assert asked == 3 * len(distil.domains_of(tiny_calib.config))  # half of the 4 + 2 windows of each domain
    with pytest.raises(ValueError, match="recall-kind"):
        distil.DistilConfig(recall_kind="after")


def test_a_recall_window_scored_against_its_quote_counts_quoted_tokens_by_excess_nll(tiny_pair, tiny_calib):
    """With ``recall_target='quote'`` a recall window's objective is, hand-computed, the mean over its
    continuation of KL(oracle ‖ method) before the quoted answer and NLL(method) − NLL(oracle) of the true
    tokens from it on; the plain windows keep the KL alone; labelled windows mark exactly the quoted ones;
    and the oracle's own cache scores 0 (sent raw, the consumer's own K, V)."""
    from scdviz import metrics, qa
    from scdviz.scd import distil

    lead = tiny_pair.tokenizer(qa.LEAD, add_special_tokens=False)["input_ids"]
    cfg = distil.DistilConfig(train_windows=2, val_windows=2, prompt_len=40, cont_len=len(lead) + 16, recall=0.5,
                              recall_target="quote")
    train, _ = distil.named_windows(tiny_pair, tiny_calib, cfg)
    train = [(w, r) for _, w, r in train]
    assert [r for _, r in train] == [distil.is_recall(i, 0.5) for i in range(2)] * (len(train) // 2)
    window = next(w for w, r in train if r)
    q = distil.quote_from(tiny_pair.tokenizer)
    assert q == len(lead) + qa.CUE and window[40 + q :] == window[40 + len(lead) :][qa.CUE :]
    case = transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window, cfg.cont_len)
    plan = _low_rank_plan(tiny_calib)
    blob = transfer.build_payload(case.state, plan, tiny_calib)
    with torch.no_grad():
        got = distil.continuation_kl(tiny_pair, distil.Target.of(case, q), blob, tiny_calib, None, False)
        plain = distil.continuation_kl(tiny_pair, distil.Target.of(case), blob, tiny_calib, None, False)
        logits = transfer.continuation(tiny_pair.consumer, transfer.receive(tiny_pair.consumer, blob, tiny_calib).cache,
                                       case.fed, case.state.ids.shape[1])[0]
    truth, ref = case.targets[0], case.oracle_logits
    kl = metrics.kl_per_token(ref, logits)
    excess = metrics.nll_per_token(logits, truth) - metrics.nll_per_token(ref, truth)
    assert float(got) == pytest.approx(float(torch.cat([kl[:q], excess[q:]]).mean()), rel=1e-5, abs=1e-7)
    assert float(plain) == pytest.approx(float(kl.mean()), rel=1e-5)
    assert float(got) != pytest.approx(float(plain), rel=1e-3)
    with torch.no_grad():  # the oracle's own cache: the consumer's own K, V sent raw
        own = transfer.build_payload(transfer.producer_state(tiny_pair.consumer, case.state.ids),
                                     plans.raw_plan(len(plan.modes)), None)
        zero = distil.continuation_kl(tiny_pair, distil.Target.of(case, q), own, None, None, False)
    assert abs(float(zero)) < 1e-4
    with pytest.raises(ValueError, match="recall-target"):
        distil.DistilConfig(recall_target="truth")


def test_row_spread_accumulated_payload_by_payload_is_the_spread_of_all_rows_at_once(tiny_pair, tiny_calib):
    from scdviz.scd import distil

    plan = _low_rank_plan(tiny_calib)
    blobs = [transfer.build_payload(transfer.prepare_case(tiny_pair.producer, tiny_pair.consumer, window_ids(48, s), 8)
                                    .state, plan, tiny_calib) for s in (3, 4, 5)]
    got = distil.row_spread(tiny_calib, iter(blobs))  # one pass over a generator
    assert sorted(got) == [i for i, m in enumerate(plan.modes) if m == "code"]
    for layer, spread in got.items():
        rows = [kv for blob in blobs for i, kv in transfer.code_rows(tiny_calib, blob) if i == layer]
        torch.testing.assert_close(spread, torch.cat(rows).double().std(0).float(), rtol=1e-5, atol=1e-6)


def test_spread_order_nests_every_smaller_set_in_a_larger_one_spread_through_the_split():
    """The windows a fit takes from a split: distinct, every index once when all are asked for, the first m of
    any longer order the order of m (so a 10x fit's spool holds the 1x fit's windows), and spread: the first
    four of 100 fall in four different quarters."""
    from scdviz.scd import distil

    assert distil.spread_order(100, 4) == [0, 50, 25, 75]
    for count in (7, 100, 501):
        full = distil.spread_order(count, count)
        assert sorted(full) == list(range(count))
        for m in (1, 3, count // 2):
            assert distil.spread_order(count, m) == full[:m]
    assert len(distil.spread_order(5, 9)) == 5  # never more than the split holds


def test_a_stopped_fit_resumes_from_its_checkpoint_to_the_same_corrections(tiny_pair, tiny_calib, tmp_path):
    """Stopped in its second epoch (the reporter raises ``Stopped``, as the app's Stop does), a fit called again
    with the same folder prepares nothing again, resumes at the step it stopped after, and ends with corrections
    and a validation log bit for bit those of a fit never interrupted; every validation is in the log once."""
    from scdviz.progress import Stopped
    from scdviz.scd import distil

    plan = _low_rank_plan(tiny_calib)
    cfg = distil.DistilConfig(val_every=0,
                              rank=4, epochs=3, train_windows=3, val_windows=1, prompt_len=40, cont_len=8, lr=1e-2,
                              budgets=[], recall=0.0)
    whole, whole_log = distil.distil(tiny_pair, tiny_calib, cfg, progress=False, at=[plan], folder=tmp_path / "a")
    seen = []

    def stop_at_step_8(desc, done, total):
        seen.append(desc)
        if desc.startswith("distil: steps") and done == 4:  # after 4 of the 9 steps, in the second epoch
            raise Stopped("stopped")

    folder = tmp_path / "b"
    with pytest.raises(Stopped):
        distil.distil(tiny_pair, tiny_calib, cfg, progress=stop_at_step_8, at=[plan], folder=folder)
    assert json.loads((folder / "checkpoint.json").read_text())["done"] == 4
    seen.clear()
    got, log = distil.distil(tiny_pair, tiny_calib, cfg, progress=lambda d, i, n: seen.append((d, i, n)),
                             at=[plan], folder=folder)
    assert all(n == 0 for d, _, n in seen if d.startswith("distil: preparing"))  # the spool held every window
    assert any("resumed at step 4" in d and n == 5 for d, _, n in seen)
    assert log["resumed_at"] == [4] and log["val_steps"] == whole_log["val_steps"] == [0, 3, 6, 9]
    assert log["val_kl"] == whole_log["val_kl"] and log["train_kl"] == whole_log["train_kl"]
    assert sorted(got.corrections) == sorted(whole.corrections)
    for layer, p in whole.corrections.items():
        for k, v in p.items():
            assert torch.equal(got.corrections[layer][k], v), (layer, k)


def test_fits_share_a_spool_and_one_of_another_recipe_is_refused(tiny_pair, tiny_calib, tmp_path):
    """A fit with more windows prepares only those the smaller one's spool lacks, and validating every 2 steps
    logs a validation at each even step and at the end; a spool prepared for another window length is refused
    by name, before any work."""
    from scdviz.scd import distil

    plan = _low_rank_plan(tiny_calib)
    cfg = distil.DistilConfig(val_every=0,
                              rank=4, epochs=1, train_windows=2, val_windows=1, prompt_len=40, cont_len=8, lr=1e-2,
                              budgets=[], recall=0.0)
    spool = tmp_path / "spool"
    distil.distil(tiny_pair, tiny_calib, cfg, progress=False, at=[plan], folder=tmp_path / "a", spool=spool)
    before = {p.name: p.stat().st_mtime_ns for p in spool.glob("*.safetensors")}
    domains = len(set(name.split("-")[1] for name in before))
    seen = []
    more = dataclasses.replace(cfg, train_windows=3, val_every=2)
    _, log = distil.distil(tiny_pair, tiny_calib, more, progress=lambda d, i, n: seen.append((d, n)), at=[plan],
                           folder=tmp_path / "b", spool=spool)
    assert [n for d, n in seen if d.startswith("distil: preparing")][0] == domains  # one new window a domain
    assert all(p.stat().st_mtime_ns == t for p in spool.glob("*.safetensors") if (t := before.get(p.name)))
    steps_ = 3 * domains
    assert log["val_steps"] == [*range(0, steps_, 2), steps_] if steps_ % 2 else [*range(0, steps_ + 1, 2)]
    with pytest.raises(ValueError, match="spool .* was prepared for"):
        distil.distil(tiny_pair, tiny_calib, dataclasses.replace(cfg, cont_len=10), progress=False, at=[plan],
                      folder=tmp_path / "c", spool=spool)

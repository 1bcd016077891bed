"""Tests that catch GPU bugs without a GPU: every SCD and eviction path on tiny models
(1) under a wrong-device trap and (2) in bfloat16.

The trap: the model lives on the CPU while ``torch.set_default_device("meta")`` is in force,
so any tensor made without naming the model's device lands on ``meta`` and the first
operation that meets real data fails. Select with ``pytest -k "bf16 or device"``.

``SCDVIZ_TEST_DEVICE=cuda`` runs the same tests with the models on a GPU (research/gpu_check.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import pytest
import torch
from conftest import tiny_model
from kvpress import KnormPress, ObservedAttentionPress
from test_scd import make_pair, perturbed, small_cfg

from scdviz.evict import bench
from scdviz.evict import features as F
from scdviz.evict.context import observe, prune
from scdviz.evict.decode import DecodeEvictor
from scdviz.evict.policy import Policy, PolicyConfig, compression_ratio
from scdviz.evict.press import DistillCachePress
from scdviz.evict.student import Student, StudentConfig, StudentPress
from scdviz.evict.train import Sample, TrainConfig, reinforce_step
from scdviz.models import hf
from scdviz.scd import calibrate as cal
from scdviz.scd import measure, payload, transfer
from scdviz.scd import plan as plans

DEVICE = torch.device(os.environ.get("SCDVIZ_TEST_DEVICE", "cpu"))  # where the tiny models live


def on_device(model, dtype=torch.float32):
    return model.to(device=DEVICE, dtype=dtype)


@contextlib.contextmanager
def wrong_device_trap():
    """Tensors created without an explicit device go to 'meta' inside the block."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def test_the_device_trap_catches_a_tensor_made_without_the_model_device():
    model = on_device(tiny_model("llama"))
    weight = next(model.parameters())
    with wrong_device_trap(), pytest.raises((NotImplementedError, RuntimeError)):
        torch.zeros(3) + weight[0, :3]  # what a forgotten device= looks like on a GPU
    with wrong_device_trap():
        assert (torch.zeros(3, device=weight.device) + weight[0, :3]).device == weight.device


def _window(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed), device="cpu").tolist()


def _scd_paths(pair, calib, dtype):
    """Every SCD plan of the line-up and the budget planner's (its curves measured here, entropy coded
    too): payload, receive, teacher-forced scoring and generation."""
    from scdviz.scd import rate

    cases = measure.prepare_cases(pair, [_window(40, s) for s in range(2)], 8, progress=False)
    curves = rate.measure(pair, calib, 1, progress=False)
    rd = plans.rd_plan(curves, 30.0, cases[0].state.ids.shape[1])[0]
    calib = dataclasses.replace(calib, rate=curves)
    lineup = [*plans.lineup(calib), rd, dataclasses.replace(rd, name="rd+entropy", entropy=True),
              plans.tc_plan(calib, 30.0)]
    oracle, gens = measure.oracle_result(pair, cases, 3)
    for plan in lineup:
        blob = transfer.build_payload(cases[0].state, plan, calib)
        if plan.rate_target:  # transform coded: the length is the data's, under the target
            assert len(blob) <= plan.rate_target * cases[0].state.ids.shape[1]
        else:
            assert len(blob) == payload.payload_len(payload.decode(blob).sections, len(plan.modes))
        got = transfer.receive(pair.consumer, blob, calib)
        assert {k.dtype for k in hf.Trace(None, got.cache, None).keys} == {dtype}, plan.name
    results = measure.run_methods(pair, calib, cases, lineup, gen_tokens=3, oracle_gen=gens, progress=False)
    assert all(math.isfinite(r.kl) and r.kl >= 0 for r in results)
    _distil_paths(pair, calib, cases[0], dtype)
    return results


def _distil_paths(pair, calib, case, dtype) -> None:
    """The correction stage: trained through the consumer (backprop in the model's dtype, float32
    parameters), and a calibration carrying one received into the consumer's dtype and device."""
    from scdviz.scd import distil

    plan = plans.operating_plan(calib)
    # the training windows' logits held on the host, moved to the device at each step
    cfg = distil.DistilConfig(val_every=0,
                              rank=2, epochs=2, train_windows=2, val_windows=1, prompt_len=32, cont_len=8, budgets=[])
    _, log = distil.distil(pair, calib, cfg, progress=False, at=[plan])
    assert all(math.isfinite(x) for x in log["val_kl"] + log["train_kl"])
    blob = transfer.build_payload(case.state, plan, calib)
    start = distil.initial(distil.row_spread(calib, [blob]), 2, 0)
    trained = dataclasses.replace(calib, corrections={i: p | {"b": torch.full_like(p["b"], 0.01)}
                                                      for i, p in start.items()})
    got = transfer.receive(pair.consumer, transfer.build_payload(case.state, plan, trained), trained)
    assert {(k.dtype, k.device) for k in hf.Trace(None, got.cache, None).keys} == {(dtype, DEVICE)}


@pytest.fixture(scope="module")
def fp32_pair_and_calib(texts):
    pair = make_pair(on_device(tiny_model("llama")), on_device(perturbed(1)))
    pair.device = DEVICE
    return pair, cal.calibrate(small_cfg(texts), pair, progress=False)


def test_scd_every_plan_under_the_wrong_device_trap(fp32_pair_and_calib):
    pair, calib = fp32_pair_and_calib
    with wrong_device_trap():
        _scd_paths(pair, calib, torch.float32)


def test_scd_calibrate_and_every_plan_in_bf16(texts):
    pair = make_pair(on_device(tiny_model("llama"), torch.bfloat16), on_device(perturbed(1), torch.bfloat16))
    pair.device, pair.dtype = DEVICE, torch.bfloat16
    calib = cal.calibrate(small_cfg(texts), pair, progress=False)
    results = _scd_paths(pair, calib, torch.bfloat16)
    assert results[0].kl > 0  # raw reuse of a different model's cache is not free


def _codec_paths(pair, calib, dtype) -> None:
    """scdviz.Codec: encode from a model, encode_kv from an engine's cache (K, V and H_in in the
    model's dtype, on its device), decode into the consumer's dtype."""
    from scdviz.scd.codec import Codec

    ids = torch.tensor([_window(40, 5)], device=DEVICE)
    trace = hf.forward(pair.producer, ids, capture={"h_in"})
    keys, values = hf.cache_kv(trace.cache)
    for codec in (Codec.of(calib, patch_k=1, bits=4), Codec.raw(calib.n_layers, bits=4)):
        h_in = {i: trace.h_in[i][0] for i in codec.plan.layers_in("patch")}
        for blob in (codec.encode(pair.producer, ids), codec.encode_kv(pair.producer, ids, keys, values, h_in)):
            cache = codec.decode(pair.consumer, blob)
            assert {k.dtype for k in hf.Trace(None, cache, None).keys} == {dtype}, codec.plan.name
            assert {k.device for k in hf.Trace(None, cache, None).keys} == {DEVICE}, codec.plan.name


def test_codec_under_the_wrong_device_trap(fp32_pair_and_calib):
    pair, calib = fp32_pair_and_calib
    with wrong_device_trap():
        _codec_paths(pair, calib, torch.float32)


def test_codec_in_bf16(fp32_pair_and_calib):
    pair, calib = fp32_pair_and_calib
    half = make_pair(on_device(tiny_model("llama"), torch.bfloat16), on_device(perturbed(1), torch.bfloat16))
    half.device, half.dtype = DEVICE, torch.bfloat16
    _codec_paths(half, calib, torch.bfloat16)


# ----------------------------------------------------------------------------- eviction


_POLICIES = {}


def _policy(per_head: bool) -> Policy:
    """A small policy made on the CPU (as Policy.load gives one); presses must move it to the model."""
    if per_head not in _POLICIES:
        with torch.device("cpu"):
            torch.manual_seed(0)
            _POLICIES[per_head] = Policy(PolicyConfig(hidden=8, per_head=per_head, window=16)).eval()
    return _POLICIES[per_head]


def _student(model, per_head: bool, window: int = 0) -> Student:
    """A random student made on the CPU (as Student.load gives one)."""
    with torch.device("cpu"):
        student = Student.for_model(model, StudentConfig(per_head=per_head, window=window))
        with torch.no_grad():
            student.weight.normal_(generator=torch.Generator().manual_seed(0))
    return student.eval()


def _eviction_paths(model, dtype, baseline):
    """Features + scores in one prefill, pruning, both presses, decode-time eviction, a REINFORCE step.

    ``baseline``: the kvpress scorer observed beside the features. kvpress's ObservedAttention makes
    a CPU arange and moves it (fine on a GPU, caught by the trap), so the trap uses Knorm.
    """
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(1), device="cpu")  # user input, on CPU
    with hf.eager(model):
        obs = observe(model, ids[:, :24], 16, {"baseline": baseline}, (0.5,))
        assert obs.keys[0].dtype == dtype and torch.isfinite(obs.head_features).all()
        cache = prune(model, obs, [s.topk(12, dim=-1).indices for s in obs.scores[("baseline", 0.5)]])
        assert hf.cache_len(cache) == [12] * hf.n_layers(model)
        for per_head in (True, False):
            with DistillCachePress(policy=_policy(per_head), compression_ratio=compression_ratio(0.25))(model):
                pruned = hf.forward(model, ids[:, :24]).cache
            assert hf.cache_len(pruned) == [6] * hf.n_layers(model)
        for scorer in (DistillCachePress(policy=_policy(True)), KnormPress()):
            full = hf.forward(model, ids[:, :19]).cache
            with DecodeEvictor(scorer, budget=8, window=4)(model):
                out = hf.generate(model, full, ids[:, 19:20], 19, 5, on_step=lambda c, s: None)
            assert len(out) == 5
        for per_head, window in ((True, 0), (False, 0), (True, 4)):  # the student: a press prefill, then arrival
            press = StudentPress.keeping(_student(model, per_head, window), 0.5)  # scores while decoding
            with hf.attention(model, "sdpa"), press(model):  # a window's rows computed from its queries
                pruned = hf.forward(model, ids[:, :19]).cache
            budget = hf.cache_len(pruned)[0]
            with DecodeEvictor(press, budget=budget, window=4)(model):
                out = hf.generate(model, pruned, ids[:, 19:20], 19, 5, on_step=lambda c, s: None)
            assert len(out) == 5 and hf.cache_len(pruned) == [budget] * hf.n_layers(model)
        ref = hf.continue_logits(model, hf.make_cache(model, obs.keys, obs.values), ids[:, 24:], 24)[0]
        policy = _policy(True).train()
        stats = reinforce_step(model, policy, Sample(obs, ids[:, 24:], ref), 6, TrainConfig(out="unused", samples=3),
                               torch.Generator(device=ids.device).manual_seed(0))
        stats["loss"].backward()
        assert stats["kl"] >= 0 and any(p.grad is not None for p in policy.parameters())
        # the benchmark's paths: every method on a context, decode-time quality, the foresight target
        cfg = bench.EvalConfig(keeps=(0.5,), token_budgets=(), cont_len=4, question_len=0, decode_tokens=4,
                                 decode_interval=2)
        with torch.device("cpu"):  # as Policy.load gives one
            torch.manual_seed(0)
            look = Policy(PolicyConfig(hidden=8, per_head=True, window=16, lookahead=2, lookahead_samples=2)).eval()
        policies = {"DistillCache-per-head": _policy(True), "distillcache-head-look": look}
        failed = {}  # (kvpress's own presses are not run here: its fake-key search fails on a random tiny model)
        scorers = {"baseline": baseline, "distillcache-student": StudentPress(student=_student(model, True)),
                   "distillcache-student-window4": StudentPress(student=_student(model, True, 4))}
        out = bench.score_context(model, ids, 24, cfg, policies, scorers, failed=failed)
        assert not failed and all(math.isfinite(r["kl"]) for k, r in out["results"].items() if k[0] != "full cache")
        assert (out["feats"][(16, 2, 2)].head_features.shape[-1] == 6
                and ("distillcache-head-look", "0.5") in out["kept"])
        dec = bench.decode_context(model, ids, 24, cfg, out, policies, scorers, failed)
        assert dec and all(len(r["kl_steps"]) == 4 for r in dec.values()) and ("distillcache-student", "0.5") in dec
        assert ("distillcache-student-window4", "0.5") in dec
        assert list(failed) == ["distillcache-head-look"]  # no lookahead while decoding: said, not crashed
        trace = hf.forward(model, ids[:, 24:], cache=hf.make_cache(model, obs.keys, obs.values),
                           positions=torch.arange(24, 30, device=hf.device_of(model)).unsqueeze(0), attentions=True)
        head, glob = F.future_attention(trace.attn, 24, hf.attn_heads(model)[1])
        assert head.device == hf.device_of(model) and torch.isfinite(glob).all()


def test_eviction_paths_under_the_wrong_device_trap():
    model = on_device(tiny_model("llama"))
    with wrong_device_trap():
        _eviction_paths(model, torch.float32, KnormPress())


def test_eviction_paths_in_bf16():
    _eviction_paths(on_device(tiny_model("llama"), torch.bfloat16), torch.bfloat16, ObservedAttentionPress())


def test_generate_under_the_wrong_device_trap_and_in_bf16():
    for model in (on_device(tiny_model("llama")), on_device(tiny_model("qwen3"), torch.bfloat16)):
        ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2), device="cpu")
        with wrong_device_trap():
            cache = hf.forward(model, ids[:, :-1]).cache
            out = hf.generate(model, cache, ids[:, -1:], 11, 4)
        assert len(out) == 4

"""scdviz.Codec, the wire API: bytes that decode alone, and the public names of scdviz."""

import dataclasses
import subprocess
import sys

import pytest
import torch

import scdviz
from scdviz.models import hf
from scdviz.scd import payload, transfer
from scdviz.scd import plan as plans
from tests.conftest import tiny_model
from tests.test_scd import make_pair, perturbed, small_cfg


@pytest.fixture(scope="module")
def pair():
    return make_pair(tiny_model("llama"), perturbed(1))


@pytest.fixture(scope="module")
def calib(pair, texts):  # noqa: F811
    return scdviz.calibrate(small_cfg(texts), pair, progress=False)


def _prefix(n: int = 40, seed: int = 3) -> torch.Tensor:
    """(1, n) random token ids of the tiny models' vocabulary."""
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def test_decode_needs_only_the_bytes_and_the_calibration(pair, calib):
    """Every lineup plan: the codec's cache equals the machinery's with the plan beside the bytes."""
    ids = _prefix()
    state = transfer.producer_state(pair.producer, ids)
    for plan in plans.lineup(calib):
        codec = scdviz.Codec(plan, calib if any(m in ("code", "patch") for m in plan.modes) else None)
        blob = codec.encode(pair.producer, ids)
        assert blob == transfer.build_payload(state, plan, calib), plan.name  # same bytes from a model or a state
        assert payload.decode(blob).layout.modes == plan.modes and payload.decode(blob).layout.sink == plan.sink
        got = scdviz.Codec(plans.raw_plan(calib.n_layers), calib).decode(pair.consumer, blob)  # another plan: unused
        want = transfer.transferred(pair.consumer, state, plan, calib)
        assert got.get_seq_length() == ids.shape[1]
        for mine, ref in zip(got.layers, want.layers):
            assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values), plan.name


def test_full_rank_fp16_codec_on_the_same_model_is_the_models_own_cache(texts):  # noqa: F811
    model = tiny_model("llama")
    same = make_pair(model, model)
    calib = scdviz.calibrate(small_cfg(texts, ridge=0.0, given=[1]), same, progress=False)
    rk, rv = plans.full_ranks(calib)
    codec = scdviz.Codec(plans.scd_plan(rk, rv, code_bits=16), calib)
    ids = _prefix()
    cache = codec.decode(model, codec.encode(model, ids))
    own = hf.decoder_cache(model, ids)
    for mine, ref in zip(cache.layers, own.layers):
        torch.testing.assert_close(mine.keys, ref.keys, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(mine.values, ref.values, atol=2e-3, rtol=1e-3)


def test_codes_of_another_calibration_or_none_are_refused(pair, calib, texts):  # noqa: F811
    codec = scdviz.Codec.of(calib, patch_k=1, bits=4)
    blob = codec.encode(pair.producer, _prefix())
    assert payload.decode(blob).layout.calibration == calib.tag != 0
    other = dataclasses.replace(calib, stats={**calib.stats, "seconds_total": -1.0})  # another fit, same shapes
    with pytest.raises(ValueError, match="not with the given"):
        scdviz.Codec(codec.plan, other).decode(pair.consumer, blob)
    with pytest.raises(ValueError, match="holds SCD codes"):
        scdviz.Codec.raw(calib.n_layers).decode(pair.consumer, blob)
    with pytest.raises(ValueError, match="give its calibration"):
        scdviz.Codec(codec.plan)
    with pytest.raises(ValueError, match=r"shape \(1, T\)"):
        codec.encode(pair.producer, _prefix()[0])
    raw = scdviz.Codec.raw(calib.n_layers).encode(pair.producer, _prefix())
    assert payload.decode(raw).layout.calibration == 0  # no codes: decodes without a calibration


def test_encode_kv_from_an_engines_cache_gives_the_same_consumer_cache(pair, calib):
    """What a connector holds (post-RoPE K, V per layer and H_in at the patch layers) codes like a prefill."""
    ids = _prefix()
    state = transfer.producer_state(pair.producer, ids)
    trace = hf.forward(pair.producer, ids, capture={"h_in"})
    keys, values = hf.cache_kv(trace.cache)
    for codec in (scdviz.Codec.raw(calib.n_layers), scdviz.Codec.raw(calib.n_layers, bits=4),
                  scdviz.Codec.of(calib, patch_k=1, bits=4), scdviz.Codec.of(calib, patch_k=0, bits=16)):
        h_in = {i: trace.h_in[i][0] for i in codec.plan.layers_in("patch")}
        blob = codec.encode_kv(pair.producer, ids, keys, values, h_in)
        if "code" not in codec.plan.modes:
            assert blob == codec.encode(state)  # raw K, V: the same bytes
        got, want = codec.decode(pair.consumer, blob), codec.decode(pair.consumer, codec.encode(state))
        for mine, ref in zip(got.layers, want.layers):  # codes of unrotated keys: equal up to rounding
            torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="give their h_in"):
        scdviz.Codec.of(calib, patch_k=1).encode_kv(pair.producer, ids, keys, values)
    droid = scdviz.Codec(plans.droidspeak_plan(calib.n_layers, [1]))
    with pytest.raises(ValueError, match="residual stream"):
        droid.encode_kv(pair.producer, ids, keys, values)


def test_a_budget_codec_holds_its_budget(pair, calib):
    from scdviz.scd import rate

    curved = dataclasses.replace(calib, rate=rate.measure(pair, calib, n_windows=2, progress=False))
    ids = _prefix(48)
    for budget in (40.0, 80.0):
        blob = scdviz.Codec.of(curved, budget=budget).encode(pair.producer, ids)
        assert len(blob) <= budget * ids.shape[1]


def test_public_names_resolve_and_import_no_torch():
    for name in scdviz.__all__:
        assert getattr(scdviz, name) is not None, name
    with pytest.raises(AttributeError):
        scdviz.no_such_name  # noqa: B018
    out = subprocess.run([sys.executable, "-c", "import sys, scdviz; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

"""Fast tier: bounded host memory (issue 58, item 5) on tiny random models.

The distilled scorer's normal equations keep H_in'H_in once per layer, never the (L, R, F, F) block, and solve one
row's (F, F) matrix at a time to the numbers the whole batch gave; ``Codec.encode`` captures and moves only what
its plan sends. The memory these save at Mistral-7B shapes is measured by ``python -m research.host_memory``
(docs/serving.md, "Host memory"); here the invariants that make it so, each of which the old code fails.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from conftest import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC2701 (torch has no public name for it)

import scdviz
from scdviz.evict.student import SHIPPED, Student, StudentConfig
from scdviz.evict.student_fit import FitConfig, NormalEquations, accumulate
from scdviz.models import hf
from scdviz.scd import payload, transfer
from scdviz.scd import plan as plans
from scdviz.scd.codec import sent_state


class _Words:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [sum(map(ord, w)) % 97 for w in text.split()]}


class _HostTensors(TorchDispatchMode):
    """Host (CPU) tensors made by torch ops while active, outside ``paused``: ``largest`` the most elements of one,
    ``peak`` the most bytes alive at once (storages counted once, gone when torch frees them)."""

    def __init__(self):
        super().__init__()
        self.live: dict = {}
        self.now = self.peak = self.largest = self.paused = 0

    def _gone(self, key) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        for t in _tensors(out):
            if t.device.type == "cpu":
                self.largest = max(self.largest, t.numel())
                storage = t.untyped_storage()
                key = (storage.data_ptr(), id(storage))
                if storage.nbytes() and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._gone, key)
        return out


def _tensors(out) -> list[torch.Tensor]:
    """The tensors an op returned (one, or a tuple / list of them and other things)."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for x in out for t in _tensors(x)] if isinstance(out, (tuple, list)) else []


def _host_peak(fn, monkeypatch) -> tuple[object, int]:
    """(fn(), the peak bytes of host tensors it made outside the producer's forward passes): what a producer on a
    GPU would hold on the host (its forward's captures and cache live on the GPU)."""
    mode, forward = _HostTensors(), hf.forward

    def paused(*args, **kwargs):
        mode.paused += 1
        try:
            return forward(*args, **kwargs)
        finally:
            mode.paused -= 1

    monkeypatch.setattr(hf, "forward", paused)
    with mode:
        out = fn()
    monkeypatch.setattr(hf, "forward", forward)
    return out, mode.peak


# ----------------------------------------------------------------------------- the student's normal equations


def _batch_solve(normal: NormalEquations, ridge: float, weight: float) -> torch.Tensor:
    """The solve before issue 58: the whole (L, R, F, F) batch at once (the decode rows weighed in, the ridge
    added through an identity without its intercept entry, one batched Cholesky)."""
    xtx, xty = normal.xtx, normal.xty
    if normal.decode is not None:
        xtx, xty = xtx + weight * normal.decode.xtx, xty + weight * normal.decode.xty
    eye = torch.eye(xtx.shape[-1], dtype=torch.float64)
    eye[-1, -1] = 0
    scale = xtx.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
    factor = torch.linalg.cholesky(xtx + ridge * 1e-3 * scale * eye)
    return torch.cholesky_solve(xty.unsqueeze(-1), factor)[..., 0].float()


@pytest.mark.parametrize("per_head", [True, False])
def test_normal_equations_hold_hin_once_per_layer_and_solve_row_by_row_as_the_whole_batch(per_head):
    model = tiny_model("llama")
    cfg = FitConfig(corpora=("austen", "gcide"), contexts=3, context_len=24, teacher_len=6, decode_len=9,
                    decode_every=4, listwise=(), student=StudentConfig(per_head=per_head, window=3))
    student = Student.for_model(model, cfg.student)
    n_layers, rows, f = student.weight.shape
    d, k = student.hidden, f - student.hidden
    normal = accumulate(model, _Words(), cfg, student, progress=False)
    # the shared layout: per layer one (d, d) block for every row, and each row's (d, k) and (k, k) blocks
    for eq in (normal, normal.decode):
        assert eq.dense is None and [t.shape for t in eq.hh] == [(d, d)] * n_layers
        assert [t.shape for t in eq.he] == [(rows, d, k)] * n_layers
        assert [t.shape for t in eq.ee] == [(rows, k, k)] * n_layers
    assert normal.nbytes() == 2 * 8 * n_layers * (d * d + rows * (d * k + k * k + f))
    assert max(t.numel() for t in [*normal.hh, *normal.he, *normal.ee]) <= rows * f * f  # never a layer's whole block
    for ridge, weight in ((1e-9, 1.0), (10.0, 0.3), (1000.0, 0.1)):
        mode = _HostTensors()
        with mode:
            got = normal.solve(ridge, weight)
        assert mode.largest <= f * f  # one row's matrix at a time, never the (L, R, F, F) batch
        torch.testing.assert_close(got, _batch_solve(normal, ridge, weight), atol=1e-10, rtol=0)


def test_the_shipped_recipes_normal_equations_at_mistral_7b_shapes_hold_under_9_gb():
    """32 layers, 8 KV heads, width 4096, the shipped student's 5 extra columns (window 32), prefill and decode
    states: 8.6 GB (the dense (L, R, F, F) layout held 34.4 GB for each of the two); counted on the meta device."""
    shipped = Student.load(SHIPPED)
    assert shipped.config.per_head and shipped.config.window  # the recipe this sizes: per KV head, with a window
    n_layers, n_kv, d = 32, 8, 4096
    f = d + shipped.config.n_extra()
    with torch.device("meta"):
        normal = NormalEquations.zeros(n_layers, n_kv, f, hidden=d)
        normal.decode = NormalEquations.zeros(n_layers, n_kv, f, hidden=d)
    assert normal.nbytes() < 9e9 and normal.nbytes() < 2 * (n_layers * n_kv * f * f * 8) / 7


# ----------------------------------------------------------------------------- the codec


@pytest.fixture(scope="module")
def bf16_producer():
    return tiny_model("llama").to(torch.bfloat16)


def _ids(n: int = 40) -> torch.Tensor:
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(3))


def _plans(calib) -> list:
    return [*plans.lineup(calib), *plans.lineup(calib, sink="send"), scdviz.Codec.of(calib, patch_k=2, bits=4).plan,
            plans.raw_plan(calib.n_layers, bits=4, window=8), plans.raw_plan(calib.n_layers, bits=8)]


def test_what_the_codec_sends_has_the_bytes_of_every_capture_in_float32(tiny_calib, bf16_producer):
    """A bf16 producer: ``sent_state`` (fp16 sections kept on the device, codes' inputs moved in their own dtype)
    gives the bytes of ``transfer.host_state`` (every capture of every layer in float32 on the host)."""
    ids = _ids()
    trace = hf.forward(bf16_producer, ids, capture=hf.CAPTURE_ALL)
    parts = (trace.keys_pre, trace.keys, trace.values, [h[0] for h in trace.h_in], [r[0] for r in trace.resid])
    for plan in _plans(tiny_calib):
        want = transfer.build_payload(transfer.host_state(ids, *parts), plan, tiny_calib)
        assert transfer.build_payload(sent_state(plan, ids, *parts), plan, tiny_calib) == want, plan.name
        codec = scdviz.Codec(plan, tiny_calib)
        assert codec.encode(bf16_producer, ids) == want, plan.name


def test_encode_captures_only_what_its_plan_reads_and_reads_each_sent_layer_once(tiny_calib, bf16_producer,
                                                                                 monkeypatch):
    asked, forward = [], hf.forward
    monkeypatch.setattr(hf, "forward", lambda *a, **k: asked.append(k) or forward(*a, **k))
    for plan in _plans(tiny_calib):
        asked.clear()
        scdviz.Codec(plan, tiny_calib).encode(bf16_producer, _ids())
        [kwargs] = asked
        modes = set(plan.modes)
        assert set(kwargs["capture"]) == {c for c, m in (("keys_pre", "code"), ("h_in", "patch"),
                                                         ("resid", "recompute")) if m in modes}, plan.name
        assert kwargs["last_logits"], plan.name  # no (T, V) logits
    trace = forward(bf16_producer, _ids(), capture=hf.CAPTURE_ALL)
    plan = scdviz.Codec.of(tiny_calib, patch_k=1, bits=4).plan
    [patch] = plan.layers_in("patch")
    state = sent_state(plan, _ids(), trace.keys_pre, trace.keys, trace.values, [h[0] for h in trace.h_in], [])
    code = plan.layers_in("code")[0]
    with pytest.raises(LookupError):
        state.keys[code]  # post-RoPE keys of a REUSE layer: not sent, never moved
    with pytest.raises(LookupError):
        state.h_in[code]
    h = state.h_in[patch]
    assert h.dtype == torch.bfloat16 and h.device.type == "cpu"  # moved in its own dtype, when read
    with pytest.raises(LookupError):
        state.h_in[patch]  # once: the state keeps no reference to what it gave


def test_encode_holds_on_the_host_about_the_payload_not_every_capture(tiny_calib, bf16_producer, monkeypatch):
    """Host tensors ``encode`` makes beyond the producer's forward (what a GPU producer's host holds): for the
    16-bit plans about the payload itself (sections kept in fp16); for every plan under half of what moving every
    capture to the host in float32 held (``transfer.producer_state``, as encode did)."""
    ids = _ids()
    for plan in _plans(tiny_calib):
        codec = scdviz.Codec(plan, tiny_calib)
        blob, ours = _host_peak(lambda c=codec: c.encode(bf16_producer, ids), monkeypatch)
        _, everything = _host_peak(lambda p=plan: transfer.build_payload(transfer.producer_state(bf16_producer, ids),
                                                                         p, tiny_calib), monkeypatch)
        assert ours < everything / 2, plan.name
        if "code" not in plan.modes and plan.raw_bits == 16:
            sent = [s for s in payload.spans(blob)[1] if s.bits == 16]
            assert ours <= 1.5 * sum(s.nbytes for s in sent), plan.name

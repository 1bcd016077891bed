"""Requests on one shared model from many threads never see each other's hooks or settings.

Fast tier, tiny random models: one thread prunes the cache inside an attention hook under
eager attention (what the eviction tab does) while others prefill with captures and decode
greedily (Generate, SCD); every result must equal the same request run alone, and the
model must be left exactly as it was (attention implementation, no hooks, no attributes).
"""

from __future__ import annotations

import threading

import torch
from conftest import tiny_model

from scdviz.models import hf


def _generate(model, ids):
    cache = hf.forward(model, ids[:, :-1]).cache
    return hf.generate(model, cache, ids[:, -1:], ids.shape[1] - 1, 6)


def _capture(model, ids):
    trace = hf.forward(model, ids, capture={"keys_pre", "h_in", "resid"})
    return torch.stack([k.sum() for k in trace.keys_pre] + [h.sum() for h in trace.h_in]).tolist()


def _evict(model, ids):
    """Prefill under eager attention keeping only the last 4 tokens per layer, then decode."""

    def keep_last(module, hidden, keys, values, attn, kwargs):
        assert attn is not None  # eager attention is on for this request only
        return keys[:, :, -4:], values[:, :, -4:]

    with hf.eager(model), hf.attention_hook(model, keep_last):
        cache = hf.forward(model, ids[:, :-1]).cache
    return hf.generate(model, cache, ids[:, -1:], ids.shape[1] - 1, 6)


def _same(a, b) -> bool:
    """Token ids exactly; captured sums to float32 rounding (OpenMP threads per OS thread may differ)."""
    if a and isinstance(a[0], float):
        return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
    return a == b


def test_concurrent_requests_equal_solo_runs():
    torch.manual_seed(0)
    model = tiny_model("llama")
    before = model.config._attn_implementation
    n_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    jobs = {f"{kind}{i}": (fn, torch.randint(0, 97, (1, 24 + 3 * i)))
            for i in range(4) for kind, fn in (("gen", _generate), ("cap", _capture), ("evict", _evict))}
    solo = {name: fn(model, ids) for name, (fn, ids) in jobs.items()}
    got, errors = {}, []
    barrier = threading.Barrier(len(jobs))

    def work(name, fn, ids):
        barrier.wait()
        try:
            for _ in range(5):
                result = fn(model, ids)
                if not _same(result, solo[name]):
                    got[name] = result
                    return
            got[name] = result
        except Exception as err:  # noqa: BLE001 - collected and reported below
            errors.append(f"{name}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=work, args=(n, fn, ids)) for n, (fn, ids) in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got.keys() == solo.keys()
    assert all(_same(got[n], solo[n]) for n in solo), {n: (got[n], solo[n]) for n in solo if not _same(got[n], solo[n])}
    assert model.config._attn_implementation == before  # eager was switched back after every eviction
    assert n_hooks == sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert not any(hasattr(layer.self_attn, "rotary_emb") for layer in hf.layers(model))


def test_exclusive_blocks_other_threads_until_released():
    model = tiny_model("llama")
    order = []
    inside = threading.Event()

    def other():
        inside.wait()
        hf.forward(model, torch.tensor([[1, 2, 3]]))
        order.append("other forward")

    t = threading.Thread(target=other)
    t.start()
    with hf.exclusive(model):
        inside.set()
        t.join(0.5)  # the other thread cannot run the model meanwhile
        order.append("block done")
    t.join(10)
    assert order == ["block done", "other forward"]

"""Fast tier: the one timing harness (scdviz.timing) and the eviction cost bench (scdviz.evict.cost) on a tiny
random model: every method timed in every round, the full cache as the denominator, budgets kept."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_model

from scdviz import timing
from scdviz.evict import bench, cost
from scdviz.evict.policy import Policy, PolicyConfig, keep_count
from scdviz.evict.student import Student, StudentConfig
from scdviz.models import hf


def test_interleaved_rounds_run_every_method_once_per_round_in_shuffled_orders():
    calls: list[str] = []

    def trial(name):
        calls.append(name)
        return {"t": float(len(calls))}

    names = ["a", "b", "c", "d"]
    samples = timing.interleaved(trial, names, rounds=5, warmup=2, rng=random.Random(0))
    assert len(calls) == 7 * 4
    rounds = [calls[i : i + 4] for i in range(0, len(calls), 4)]
    assert all(sorted(r) == names for r in rounds)  # each method once per round
    assert len({tuple(r) for r in rounds}) > 1  # the order changes between rounds
    for name in names:  # the warm-up rounds are not kept: the samples are the calls of rounds 3..7
        assert samples[name, "t"] == [float(4 * k + r.index(name) + 1) for k, r in enumerate(rounds) if k >= 2]
    assert timing.quantiles([4.0, 1.0, 3.0, 2.0, 5.0])[1] == 3.0 and timing.quantiles([2.0]) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        timing.interleaved(trial, names, rounds=0, warmup=0, rng=random.Random(0))


class _Words:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [sum(map(ord, w)) % 97 for w in text.split()]}


def test_cost_times_every_method_against_a_plain_prefill(tmp_path):
    model = tiny_model("llama")
    torch.manual_seed(0)
    paths = []
    for name, config in (("head", PolicyConfig(hidden=4, per_head=True, window=8)),
                         ("look", PolicyConfig(hidden=4, per_head=True, window=8, lookahead=3, lookahead_samples=2))):
        (tmp_path / name).mkdir()
        Policy(config).save(tmp_path / name / "best.safetensors")
        paths.append(str(tmp_path / name / "best.safetensors"))
    window = Student.for_model(model, StudentConfig(window=4))  # reads the decode steps' attention rows
    paths.append(str(window.save(tmp_path / "window.safetensors")))
    # decode_interval 2: the evicting trials cut (12 kept + 4 steps reach 12 + 2), so a press the evictor changed
    # would keep another budget at the next round's prefill (each method's kept tokens come from its last trial)
    cfg = cost.CostConfig(policies=tuple(paths), context_lens=(48,), keep=0.25, decode_steps=4, decode_interval=2,
                          rounds=2, warmup=1)
    rows = cost.run(cfg, model, _Words(), progress=False)
    by = {r["method"]: r for r in rows}
    lineup = [m.name for m in cost.methods(cfg, 12, 48)]
    assert list(by) == lineup and {"DistillCache-per-head", "lookahead-policy"} <= set(by)
    student = "distilled-scorer-closed-form"
    assert {m.name: m.evict_attn for m in cost.methods(cfg, 12, 48)}[student] == hf.ROWS
    full = by[cost.FULL]
    assert full["added_ttft_ms"] == 0 and full["prefill_ratio"] == 1 and full["throughput_vs_full"] == 1
    assert full["tokens_kept"] == 48
    assert "cannot_run" in by["KVzip"] and "cannot_run" in by["FastKVzip"]  # no tokenizer / no hub: said, not raised
    n_keep = keep_count(48, 0.25)
    for name, r in by.items():
        if "cannot_run" in r or name == cost.FULL:
            continue
        assert r["rounds"] == 2 and r["prefill_ms"] > 0 and r["decode_ms_per_token"] > 0
        assert r["added_ttft_ms"] == pytest.approx(r["prefill_ms"] - full["prefill_ms"], abs=0.11)
        assert r["tokens_kept"] == pytest.approx(n_keep, abs=0.01), name  # every method at the same budget
        can_evict = name in bench.DECODE_BASELINES or name in ("DistillCache-per-head", student)
        assert (r["evicting_ms_per_token"] is not None) == can_evict, name
    assert model.config._attn_implementation == "sdpa"  # restored, and no kvpress mask left behind
    assert all(getattr(layer.self_attn, "masked_key_indices", None) is None for layer in hf.layers(model))
    with pytest.raises(ValueError, match="decode-steps must be at least 3"):
        cost.run(cost.CostConfig(decode_steps=2), model, _Words())

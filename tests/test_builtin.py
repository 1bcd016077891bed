"""Slow tier: the built-in pair loads, each specialist differs from the producer as its
model card says, and generation runs on both."""

from __future__ import annotations

import json

import pytest
import torch

from scdviz import drift, qa
from scdviz.app import pairs
from scdviz.app.requests import GenerateRequest
from scdviz.models import builtin, hf
from scdviz.models.pair import load_pair, training_log

pytestmark = pytest.mark.slow


def test_builtin_pair_facts(builtin_pair):
    f = builtin_pair.producer_facts
    assert (f.architecture, f.layers, f.hidden, f.heads, f.kv_heads, f.head_dim, f.vocab) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 64, 49152)
    assert f.kv_bytes_per_token_fp16 == 23040
    assert builtin_pair.consumer_facts == f or builtin_pair.consumer_facts.params == f.params


def test_the_specialists_are_shipped_each_with_a_card_and_a_calibration():
    from scdviz.scd import calibration

    assert {"jargon", "austen-before"} <= set(builtin.specialists())
    for name in builtin.specialists():
        folder = builtin.adapter_dir(name)
        assert (folder / "README.md").is_file() and (folder / "eval.json").is_file()
        assert (calibration.shipped_folder(f"builtin:{name}") / calibration.FILE).is_file()
        assert sum(f.stat().st_size for f in folder.iterdir()) < 20 * 2**20  # adapters stay small


def test_the_task_specialist_beats_the_producer_at_its_task_and_raw_reuse_does_not_keep_it():
    """Their cards, each on its own training corpus: austen-before answers its question (``before``) at least 1.2×
    as well as the producer alone (issue 62's bar for a specialist), raw reuse answers it worse than the specialist
    from its own cache, and raw reuse drifts further from austen-before's oracle than from the light all-linear
    jargon adapter's (higher KL, lower top-1), while staying above the producer alone (the floor it tends toward)."""
    cards = {n: json.loads((builtin.adapter_dir(n) / "eval.json").read_text())["corpora"][builtin.training_corpus(n)]
             for n in ("jargon", "austen-before")}
    strong, light = cards["austen-before"], cards["jargon"]
    assert strong["qa_f1_oracle"] >= 1.2 * strong["qa_f1_producer"]
    assert strong["qa_f1_reuse"] < strong["qa_f1_oracle"]
    assert strong["kl_reuse"] > light["kl_reuse"] and strong["top1_reuse"] < light["top1_reuse"] - 0.03
    assert strong["top1_producer"] < strong["top1_reuse"]


@pytest.mark.parametrize("name", ["jargon", "austen-before"])
def test_specialist_differs_from_producer_as_its_card_says(name):
    """The card's row for the specialist's own corpus is measured again, whole (its 16 windows spread through the
    dev slice), and reproduces; and what it says holds: a task specialist answers its question at least 1.2× as
    well as the producer alone (austen-before models Austen's text worse than the producer), a text specialist
    models its corpus better than the producer."""
    card = json.loads((builtin.adapter_dir(name) / "eval.json").read_text())
    pair = load_pair("builtin:smollm2-135m", f"builtin:{name}")
    assert any(not torch.equal(a, b) for a, b in zip(pair.producer.parameters(), pair.consumer.parameters()))
    corpus = builtin.training_corpus(name)
    want = card["corpora"][corpus]
    report = drift.evaluate_pair(pair, n_prompts=want["n_prompts"], prompt_len=card["prompt_len"],
                                 cont_len=card["cont_len"], corpora=[corpus])
    got = report["corpora"][corpus]
    assert report["windows"] == card["windows"] == "dev" and got.keys() == want.keys()
    # a greedy answer token may flip on a near-tie under another thread count: one token of 128 is 0.008 of F1
    assert all(got[k] == pytest.approx(want[k], rel=0.01, abs=0.01) for k in want), (got, want)
    task = training_log(f"builtin:{name}")["config"].get("task", "text")
    if task in qa.KINDS:
        assert card["question"] == task and want["qa_f1_oracle"] >= 1.2 * want["qa_f1_producer"]
    else:
        assert want["ppl_consumer"] < want["ppl_producer"]
    assert want["top1_reuse"] < 1.0 and want["kl_reuse"] > 0.05  # raw reuse drifts


def test_generation_runs_on_both(builtin_pair):
    gen = pairs.generate_both(builtin_pair, GenerateRequest("The hacker looked at the terminal and", 8))
    assert len(gen.producer_ids) == len(gen.consumer_ids) == 8
    assert gen.producer_text and gen.consumer_text


def test_real_pair_cache_round_trip(builtin_pair):
    ids = builtin_pair.tokenizer("In the beginning was the word, and the word", return_tensors="pt")["input_ids"]
    m = builtin_pair.consumer
    tr = hf.forward(m, ids[:, :-3], capture={"keys_pre"})
    rebuilt = hf.make_cache(m, [k.clone() for k in tr.keys], [v.clone() for v in tr.values])
    full = hf.forward(m, ids).logits[:, -3:]
    torch.testing.assert_close(hf.continue_logits(m, rebuilt, ids[:, -3:], ids.shape[1] - 3), full,
                               atol=1e-4, rtol=1e-4)

"""Fast tier: the SCD view asks the consumer's question about the text (``transfer_view(extra={"qa_answer_len": n})``,
what the SCD tab's "Ask its question" shows), on tiny random models."""

from __future__ import annotations

import pytest

from scdviz import metrics, qa
from scdviz.models import hf
from scdviz.scd import view

TEXT = " ".join(["the cat sat on the mat and looked at the dog while the bird sang"] * 8)


def test_each_methods_answer_is_a_greedy_answer_scored_against_the_reference(tiny_pair, tiny_calib):
    """Every method answers once, ``answer_len`` tokens; its F1 is token-F1 against the question's reference; the
    oracle's answer is the consumer's own greedy answer from its own prefill of the prompt (all but the last token,
    which the question feeds first), computed here without the bench."""
    n, cont = 6, 8
    report = view.transfer_view(tiny_pair, tiny_calib, TEXT, cont_len=cont, gen_tokens=0, extra={"qa_answer_len": n})
    window = view.window_of(tiny_pair, TEXT, cont, 10_000)
    kind, item = view.question_of(tiny_pair, window, cont, n)
    assert kind == "quote" and len(item.answer) == n  # a consumer without a fine-tuning task: continue a quote
    for r in report.methods:
        assert len(r.qa_answers) == 1 and len(r.qa_answers[0]) == n, r.method
        assert r.qa_f1 == [metrics.token_f1(r.qa_answers[0], item.answer)], r.method
    prompt = window[: len(window) - cont]
    consumer = tiny_pair.consumer
    cache = hf.decoder_cache(consumer, hf.ids_tensor(prompt[:-1], hf.device_of(consumer)))
    own = qa.answer(consumer, cache, item, len(prompt) - 1)
    oracle = next(r for r in report.methods if r.method == "oracle")
    assert oracle.qa_answers[0] == own["answer"] and oracle.qa_f1[0] == own["qa_f1"]
    table = report.table().set_index("method")
    assert table.loc["raw KV", "qa_f1"] == round(next(r for r in report.methods if r.method == "raw KV").qa_f1[0], 3)


def test_not_asked_means_no_answers_and_a_short_prompt_is_refused_by_name(tiny_pair, tiny_calib):
    report = view.transfer_view(tiny_pair, tiny_calib, TEXT, cont_len=8, gen_tokens=0)
    assert all(not r.qa_answers and not r.qa_f1 for r in report.methods)
    assert "qa_f1" not in report.table()
    short = " ".join(TEXT.split()[:12])  # ~50 tokens: enough for SCD (8 + 16), too few to quote from (60)
    with pytest.raises(ValueError, match="asking the consumer's question needs at least"):
        view.transfer_view(tiny_pair, tiny_calib, short, cont_len=8, gen_tokens=0, extra={"qa_answer_len": 8})

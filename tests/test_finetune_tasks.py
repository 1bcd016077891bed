"""The context-QA tasks a specialist can be fine-tuned on (issue 62): the questions ``qa.make_item`` asks and the
training sequences ``finetune`` builds from them, on a tokenizer that maps each character to one id."""

from __future__ import annotations

import json
import random

import pytest

from scdviz import qa
from scdviz.finetune import FinetuneConfig, example, finetune


class Tok:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1000 + ord(c) for c in text]}


def _ids(text: str) -> list[int]:
    return Tok()(text)["input_ids"]


def test_a_backward_question_quotes_the_context_and_answers_with_the_tokens_before_nearest_first():
    context = list(range(300))
    head, tail = (_ids(x) for x in qa.BEFORE)
    for index in range(7):
        item = qa.make_item(Tok(), context, index, answer_len=5, pending=[299], kind="before")
        assert item.question[0] == 299 and item.question[1 : 1 + len(head)] == head
        assert item.question[-len(tail) :] == tail
        cue = item.question[1 + len(head) : -len(tail)]
        start = cue[0]
        assert len(cue) == qa.CUE and cue == context[start : start + qa.CUE]
        assert item.answer == [start - 1 - i for i in range(5)]  # the five before the quote, the nearest first
        assert 100 <= start + qa.CUE < 200  # the quote ends where a forward question's would (the middle third)


def test_a_backward_question_near_the_start_still_has_its_whole_answer_in_the_context():
    context = list(range(30))  # a third is 10 tokens: the quote must move right to leave 8 before it
    item = qa.make_item(Tok(), context, 0, answer_len=8, kind="before")
    assert item.answer == list(range(7, -1, -1))
    with pytest.raises(ValueError, match="unknown question kind"):
        qa.make_item(Tok(), context, 0, kind="after")


@pytest.mark.parametrize("task", qa.KINDS)
def test_a_task_example_is_the_window_then_the_question_and_only_the_answer_is_a_target(task):
    window = list(range(64))
    cfg = FinetuneConfig(task=task, answer_len=4, seq_len=64)
    ids, labels = example(Tok(), window, cfg, random.Random(3))
    item = qa.make_item(Tok(), window, random.Random(3).randrange(64), 4, kind=task)  # the same draw
    assert ids == window + item.question + item.answer and len(labels) == len(ids)
    assert labels[-4:] == item.answer and set(labels[:-4]) == {-100}


def test_text_examples_are_the_window_with_every_token_a_target():
    window = list(range(50))
    assert example(Tok(), window, FinetuneConfig(), random.Random(0)) == (window, window)


def test_a_task_finetune_trains_on_the_question_format_and_logs_it(tmp_path, texts):
    from conftest import tiny_folder, user_text

    base = tiny_folder(tmp_path / "base", user_text())
    cfg = FinetuneConfig(texts=str(texts), base=str(base), out=str(tmp_path / "spec"), task="before", answer_len=4,
                         steps=2, batch=2, seq_len=48, rank=2)
    log = finetune(cfg)
    saved = json.loads((tmp_path / "spec" / "train_log.json").read_text())
    assert saved["config"]["task"] == "before" and saved["config"]["answer_len"] == 4
    assert len(log["loss"]) == 2
    from scdviz.models.pair import load_model

    tokenizer = load_model(str(base))[1]
    n = len(example(tokenizer, list(range(48)), cfg, random.Random(0))[0])  # window, question and answer
    assert n > 48 + 4 and log["tokens_seen"] == 2 * 2 * n  # steps × batch × the tokens of each sequence
    with pytest.raises(ValueError, match="answer_len must be 1..16"):
        finetune(FinetuneConfig(**{**cfg.__dict__, "answer_len": 17}))


def test_adapters_on_chosen_layers_leave_the_other_layers_as_the_base_model(tmp_path, texts):
    from conftest import tiny_folder, user_text
    from safetensors.torch import load_file

    base = tiny_folder(tmp_path / "base", user_text())
    cfg = FinetuneConfig(texts=str(texts), base=str(base), out=str(tmp_path / "spec"), steps=1, batch=2, seq_len=32,
                         rank=2, layers=[0], targets=["k_proj", "v_proj"])
    finetune(cfg)
    names = load_file(str(tmp_path / "spec" / "adapter_model.safetensors"))
    assert names and all(".layers.0." in n and ("k_proj" in n or "v_proj" in n) for n in names)
    with pytest.raises(ValueError, match="--layers are 0 to"):
        finetune(FinetuneConfig(**{**cfg.__dict__, "layers": [99]}))


def test_the_scd_bench_asks_a_specialist_the_question_it_was_trained_for(tmp_path):
    from types import SimpleNamespace

    from scdviz.scd.bench import ScdBenchConfig, qa_kind

    def consumer(task: str | None) -> SimpleNamespace:
        folder = tmp_path / str(task)
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{}")
        if task:
            (folder / "train_log.json").write_text(json.dumps({"config": {"task": task}}))
        return SimpleNamespace(consumer_source=str(folder))

    before, text, unlogged = consumer("before"), consumer("text"), consumer(None)
    assert qa_kind(ScdBenchConfig(), before) == "before"
    assert qa_kind(ScdBenchConfig(), text) == qa_kind(ScdBenchConfig(), unlogged) == "quote"
    assert qa_kind(ScdBenchConfig(qa_kind="quote"), before) == "quote"  # asked for, it wins
    assert qa_kind(ScdBenchConfig(), SimpleNamespace(consumer_source="builtin:jargon")) == "quote"


def test_the_text_loss_adds_the_windows_mean_loss_to_the_answers():
    import torch
    from conftest import tiny_model

    from scdviz.finetune import batch_loss

    model = tiny_model()
    batch = torch.randint(0, 97, (2, 20))
    answer = torch.full_like(batch, -100)
    answer[:, -3:] = batch[:, -3:]
    window = torch.full_like(batch, -100)
    window[:, :12] = batch[:, :12]
    with torch.no_grad():
        alone = batch_loss(model, batch, answer)
        both = batch_loss(model, batch, answer, text_len=12)
        weighted = batch_loss(model, batch, answer, text_len=12, text_weight=0.2)
        off = batch_loss(model, batch, answer, text_len=12, text_weight=0.0)
        expected = model(input_ids=batch, labels=answer).loss + model(input_ids=batch, labels=window).loss
        expected_w = model(input_ids=batch, labels=answer).loss + 0.2 * model(input_ids=batch, labels=window).loss
    assert torch.allclose(both, expected, atol=1e-5) and not torch.allclose(both, alone)
    assert torch.allclose(weighted, expected_w, atol=1e-5) and torch.equal(off, alone)


def test_a_stopped_finetune_resumes_from_its_checkpoint_and_ends_as_an_unstopped_one(tmp_path, texts):
    import torch
    from conftest import tiny_folder, user_text
    from safetensors.torch import load_file

    base = tiny_folder(tmp_path / "base", user_text())
    cfg = FinetuneConfig(texts=str(texts), base=str(base), task="before", answer_len=3, steps=5, batch=2, seq_len=40,
                         rank=2, lr=0.05, checkpoint_every=2)
    whole = finetune(FinetuneConfig(**{**cfg.__dict__, "out": str(tmp_path / "whole")}))

    class Stop(Exception):
        pass

    def stop_at_four(frac, _desc):
        if frac >= 0.8:
            raise Stop

    stopped = FinetuneConfig(**{**cfg.__dict__, "out": str(tmp_path / "stopped")})
    with pytest.raises(Stop):
        finetune(stopped, progress=stop_at_four)
    assert json.loads((tmp_path / "stopped" / "checkpoint" / "state.json").read_text())["step"] == 4
    with pytest.raises(ValueError, match="other settings"):
        finetune(FinetuneConfig(**{**stopped.__dict__, "lr": 0.01}))
    again = finetune(stopped)
    assert again["loss"] == whole["loss"] and len(again["loss"]) == 5
    a, b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("whole", "stopped"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "stopped" / "checkpoint").exists()


def test_pair_info_scores_the_consumers_task_for_the_producer_the_oracle_and_raw_reuse(tmp_path, texts):
    """``drift.evaluate_pair`` asks the question the consumer was trained on: an identical pair answers it the same
    three ways, and the answers come from copies of the caches (the drift numbers are those without them)."""
    import torch
    from conftest import tiny_model
    from test_scd import make_pair, perturbed

    from scdviz import data, drift
    from scdviz.models import hf

    folder = tmp_path / "before"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    (folder / "train_log.json").write_text(json.dumps({"config": {"task": "before"}}))
    base = tiny_model("llama")
    same = drift.evaluate_pair(make_pair(base, base, str(folder)), n_prompts=3, prompt_len=40, cont_len=8,
                               texts=texts)
    row = same["corpora"]["texts"]
    assert same["question"] == "before" and same["answer_len"] == qa.ANSWER_LEN
    assert row["qa_f1_producer"] == row["qa_f1_oracle"] == row["qa_f1_reuse"] and row["kl_reuse"] == 0

    pair = make_pair(base, perturbed(1))
    assert drift.evaluate_pair(pair, n_prompts=2, prompt_len=40, cont_len=8, texts=texts)["question"] == "quote"
    window = data.token_windows(pair.tokenizer, data.passages("texts", "eval", texts), 48, 1)[0]
    prompt = window[:40]
    item = qa.make_item(pair.tokenizer, prompt, 0, qa.ANSWER_LEN, pending=prompt[-1:], kind="quote")
    asked, plain = drift.reuse_drift(pair, window, 8, item), drift.reuse_drift(pair, window, 8)
    assert {k: asked[k] for k in plain} == plain  # answering first leaves the continuation as it was
    prefix = torch.tensor([prompt[:-1]])
    direct = {"qa_f1_producer": qa.answer(pair.producer, hf.forward(pair.producer, prefix).cache, item, 39),
              "qa_f1_oracle": qa.answer(pair.consumer, hf.forward(pair.consumer, prefix).cache, item, 39),
              "qa_f1_reuse": qa.answer(pair.consumer, hf.forward(pair.producer, prefix).cache, item, 39)}
    assert {k: asked[k] for k in drift.TASK} == {k: v["qa_f1"] for k, v in direct.items()}


def test_a_task_specialists_card_gives_its_task_for_the_producer_the_specialist_and_raw_reuse():
    from scdviz import modelcard

    log = {"config": {"corpus": "austen", "rank": 32, "alpha": None, "steps": 3, "batch": 4, "seq_len": 256,
                      "lr": 0.002, "warmup": 5, "seed": 0, "task": "before", "answer_len": 8, "text_loss": 0.3,
                      "layers": [15, 16], "targets": ["q_proj", "v_proj"]},
           "loss": [3.0, 2.0, 1.0], "tokens_seen": 100, "train_windows_available": 9, "torch_threads": 2,
           "seconds": 5.0}
    row = {"ppl_producer": 36.9, "ppl_consumer": 43.4, "ppl_cont_oracle": 43.0, "ppl_cont_reuse": 41.0,
           "kl_reuse": 0.11, "kl_reuse_se": 0.01, "top1_reuse": 0.78, "top1_producer": 0.7, "n_prompts": 16}
    task = {"qa_f1_producer": 0.05, "qa_f1_oracle": 0.24, "qa_f1_reuse": 0.156}
    report = {"prompt_len": 256, "cont_len": 32, "question": "before", "answer_len": 8,
              "corpora": {"austen": {**row, **task}, "bible": {**row, **task, "qa_f1_oracle": 0.0}}}
    card = modelcard.render("austen-before", log, report)
    assert "| austen | 0.050 | 0.240 | 0.156 | 0.65× |" in card and "| bible | 0.050 | 0.000 | 0.156 | — |" in card
    assert "(`before`," in card and "every number in these tables" in card
    assert ("--task before --answer-len 8 --text-loss 0.3 --targets q_proj v_proj --layers 15 16 --name austen-before"
            in card) and "in layers 15, 16 (the others are the producer's)" in card and "plus 0.3 ×" in card
    old = {**report, "corpora": {"austen": row}}  # an eval.json made before the task columns
    plain = modelcard.render("austen-before", log, old)
    assert "F1 raw reuse" not in plain and "every number in this table" in plain
    assert "2 threads" in card and "1 thread," in modelcard.render("austen-before", {**log, "torch_threads": 1}, old)
    older = {**report, "corpora": {"austen": {k: v for k, v in row.items() if k != "top1_producer"}}}
    row_of_older = "| austen (in-domain) | 36.90 | 43.40 | 43.00 | 41.00 | 0.110 ± 0.010 | 0.780 | — | 16 |"
    assert row_of_older in modelcard.render("austen-before", log, older)  # every column, without producer-alone

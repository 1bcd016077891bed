"""Fast tier: shipped text splits, passage files, prompt convention and prompt limits."""

from __future__ import annotations

import json

import pytest
import torch

from scdviz import data, service


def test_shipped_splits_exist_never_overlap_and_fit_the_budget():
    assert set(data.corpora()) >= {"jargon", "bible"}
    total = 0
    for corpus in data.corpora():
        splits = {s: set(data.load_split(corpus, s)) for s in data.SPLITS}
        assert all(len(p) > 10 for p in splits.values())
        assert not splits["train"] & splits["calib"]
        assert not splits["train"] & splits["eval"]
        assert not splits["calib"] & splits["eval"]
        total += sum(data.split_path(corpus, s).stat().st_size for s in data.SPLITS)
    assert total <= 3 * 1024 * 1024


def test_read_passages_txt_and_jsonl(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("one\ntwo\n\n\nthree\n")
    assert data.read_passages(txt) == ["one\ntwo", "three"]
    jl = tmp_path / "b.jsonl"
    jl.write_text(json.dumps({"text": "x"}) + "\n\n" + json.dumps({"text": "y"}) + "\n")
    assert data.read_passages(jl) == ["x", "y"]
    jl.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="no 'text' field"):
        data.read_passages(jl)
    with pytest.raises(ValueError, match="not found"):
        data.read_passages(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="unknown corpus"):
        data.split_path("nope", "eval")


class _Tok:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_token_windows_are_exact_and_disjoint():
    windows = data.token_windows(_Tok(), ["abcdef", "ghij"], 4)
    assert windows == [[97, 98, 99, 100], [101, 102, 10, 10], [103, 104, 105, 106]]
    assert data.token_windows(_Tok(), ["abcdefghij"], 2, limit=3) == [[97, 98], [99, 100], [101, 102]]


def test_split_prompt_convention():
    prefix, fed, targets = data.split_prompt(list(range(10)), 3)
    assert prefix.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert fed.tolist() == [[6, 7, 8]]
    assert targets.tolist() == [[7, 8, 9]]
    assert isinstance(prefix, torch.Tensor)


class _FakePair:
    tokenizer = _Tok()


def test_prompt_limits(monkeypatch):
    monkeypatch.setenv("SCDVIZ_MAX_PROMPT_TOKENS", "5")
    with pytest.raises(service.UserError, match="empty"):
        service.encode_prompt(_FakePair(), "   ")
    with pytest.raises(service.UserError, match="6 tokens; this app accepts at most 5"):
        service.encode_prompt(_FakePair(), "abcdef")
    with pytest.raises(service.UserError, match="at least 2 tokens"):
        service.encode_prompt(_FakePair(), "a")
    assert service.encode_prompt(_FakePair(), "abc") == [97, 98, 99]
    with pytest.raises(service.UserError, match="choose a consumer"):
        service.get_pair("builtin:smollm2-135m", "")

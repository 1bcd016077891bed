"""Fast tier: shipped text splits, passage files, prompt convention and prompt limits."""

from __future__ import annotations

import json

import pytest
import torch

from scdviz import data
from scdviz.app import pairs

SHIPPED = {"jargon", "bible", "gcide", "austen", "handbook", "manpages"}
MIN_CHARS = {"train": 300_000, "calib": 100_000, "eval": 100_000}
# Independent checks use software-licence texts and Python documentation, so no shipped split may
# contain either; these phrases occur in licence texts / Python docs, not in ordinary prose about them.
FORBIDDEN = (
    "GNU General Public License",
    "GNU Free Documentation License",
    "Permission is hereby granted",
    "Permission is granted to copy",
    "THE SOFTWARE IS PROVIDED",
    "Redistribution and use in source and binary forms",
    "WITHOUT ANY WARRANTY",
    "MERCHANTABILITY",
    "This program is free software",
    "SPDX-License-Identifier",
    ">>> import",
    "Python Software Foundation",
    "docs.python.org",
)


def split_problems(folder) -> list[str]:
    """What is wrong with the train/calib/eval files in ``folder`` (empty when nothing is)."""
    problems, passages = [], {}
    for split in data.SPLITS:
        path = next(folder / n for n in (f"{split}.txt", f"{split}.txt.gz") if (folder / n).is_file())
        text = data.read_text(path)
        if len(text) < MIN_CHARS[split]:
            problems.append(f"{split}: {len(text)} characters < {MIN_CHARS[split]}")
        passages[split] = data.read_passages(path)
        if len(set(passages[split])) != len(passages[split]):
            problems.append(f"{split}: a passage occurs twice")
        folded = text.casefold()
        problems += [f"{split}: contains {m!r}" for m in FORBIDDEN if m.casefold() in folded]
    for a, b in (("train", "calib"), ("train", "eval"), ("calib", "eval")):
        if set(passages[a]) & set(passages[b]):
            problems.append(f"{a} and {b} share a passage")
    return problems


def test_shipped_corpora_exist_and_fit_the_budget():
    assert set(data.corpora()) >= SHIPPED
    total = sum(data.split_path(c, s).stat().st_size for c in data.corpora() for s in data.SPLITS)
    assert total <= 6 * 1024 * 1024


@pytest.mark.parametrize("corpus", sorted(SHIPPED))
def test_shipped_splits_are_disjoint_big_enough_and_clean(corpus):
    assert split_problems(data.TEXT_DIR / corpus) == []
    lengths = sorted(len(p) for s in data.SPLITS for p in data.load_split(corpus, s))
    assert 500 <= lengths[len(lengths) // 2] <= 5000  # passages of a useful size, not lines or books


def test_split_checks_catch_overlap_size_duplicates_and_licence_text(tmp_path):
    shared = "A passage that is in two splits."
    (tmp_path / "train.txt").write_text(shared + "\n\n" + "x" * 300_000 + "\n")
    (tmp_path / "calib.txt").write_text(shared + "\n\n" + "y" * 100_000 + "\n")
    (tmp_path / "eval.txt").write_text("z" * 100_000 + '\n\nTHE SOFTWARE IS PROVIDED "AS IS"\n\n>>> import os\n')
    assert split_problems(tmp_path) == [
        "eval: contains 'THE SOFTWARE IS PROVIDED'",
        "eval: contains '>>> import'",
        "train and calib share a passage",
    ]
    (tmp_path / "calib.txt").write_text("y" * 60_000 + "\n\n" + "y" * 60_000 + "\n")
    (tmp_path / "eval.txt").write_text("z" * 50_000 + "\n")
    assert split_problems(tmp_path) == ["calib: a passage occurs twice", "eval: 50001 characters < 100000"]
    (tmp_path / "eval.txt").write_text("Python Software Foundation\n")
    assert "eval: contains 'Python Software Foundation'" in split_problems(tmp_path)


def test_prepare_text_cleaning_helpers():
    from scdviz import prepare_text as pt

    entry = "Coak \\Coak\\ (k[=o]k), n. [F. caf['e].]\n   See {Coke}, n. [Obs.]\n   [1913 Webster] Coal\n"
    assert pt.gcide_clean(entry) == "Coak, n. [F. café.] See Coke, n. [Obs.]"
    long = " ".join(f'"Sentence {i}," said she.' for i in range(300))
    pieces = pt.split_long(long)
    assert " ".join(pieces) == long and all(len(p) <= 1500 for p in pieces)
    kept = pt.drop_boilerplate(["Prose.", "This program is distributed WITHOUT ANY WARRANTY.", ">>> import os"])
    assert kept == ["Prose."]
    assert pt.join_rows(["  are Linux-", "  specific and", "  x -", "  y"]) == "are Linux-specific and x - y"
    page = "\n".join(
        [
            "read(2)   System Calls Manual   read(2)",
            "NAME",
            "       read - read from a file descriptor",
            "",
            "LIBRARY",
            "       Standard C library",
            "",
            "SYNOPSIS",
            "       #include <unistd.h>",
            "",
            "       ssize_t read(int fd, void *buf, size_t count);",
            "",
            "ERRORS",
            "       EBADF  fd is not a valid",
            "              file descriptor.",
            "",
            "SEE ALSO",
            "       write(2)",
            "",
            "Linux man-pages 6.03  read(2)",
        ]
    )
    seen: set[str] = set()
    assert pt.manpage_paragraphs(page, seen) == [
        "NAME",
        "read - read from a file descriptor",
        "SYNOPSIS",
        "#include <unistd.h>",
        "ssize_t read(int fd, void *buf, size_t count);",
        "ERRORS",
        "EBADF fd is not a valid file descriptor.",
    ]
    assert pt.manpage_paragraphs(page, seen) == [
        "SYNOPSIS",
        "#include <unistd.h>",
        "ssize_t read(int fd, void *buf, size_t count);",
    ]


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
    # spread: 7 windows (ab cd ef gh ij kl and the blank line), 2 of them at floor((i + 1/2) * 7 / 2) = 1, 5
    assert data.token_windows(_Tok(), ["abcdefghijkl"], 2, limit=2, spread=True) == [[99, 100], [107, 108]]
    assert data.token_windows(_Tok(), ["abcd"], 2, limit=5, spread=True) == [[97, 98], [99, 100], [10, 10]]


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
    with pytest.raises(pairs.UserError, match="empty"):
        pairs.encode_prompt(_FakePair(), "   ")
    with pytest.raises(pairs.UserError, match="6 tokens; this app accepts at most 5"):
        pairs.encode_prompt(_FakePair(), "abcdef")
    with pytest.raises(pairs.UserError, match="at least 2 tokens"):
        pairs.encode_prompt(_FakePair(), "a")
    assert pairs.encode_prompt(_FakePair(), "abc") == [97, 98, 99]
    with pytest.raises(pairs.UserError, match="choose a consumer"):
        pairs.get_pair("builtin:smollm2-135m", "")


@pytest.mark.parametrize("corpus", sorted(SHIPPED))
def test_dev_and_test_slices_split_each_eval_split_once(corpus):
    passages = data.load_split(corpus, "eval")
    dev, test = data.slice_passages(passages, "dev"), data.slice_passages(passages, "test")
    assert [i for i, _ in dev] + [i for i, _ in test] == list(range(len(passages)))  # disjoint, covering, in order
    assert len(dev) == -(-3 * len(passages) // 10)  # the first 30 %, rounded up
    assert [p for _, p in dev + test] == passages
    with pytest.raises(ValueError, match="unknown slice"):
        data.slice_passages(passages, "eval")


def test_eval_windows_are_spread_through_the_slice_and_name_their_passage(tmp_path):
    passages = ["".join(chr(256 + 30 * i + k) for k in range(30)) for i in range(20)]  # 30 distinct characters
    (tmp_path / "t.txt").write_text("\n\n".join(passages))
    text = tmp_path / "t.txt"
    # user text: passages 4, 9, 14, 19 are its eval split (i % 5 == 4): dev = [4, 9], test = [14, 19]
    test = data.eval_windows(_Tok(), data.USER, "test", 8, 2, text)
    assert len(test) == 2 and {w.passage for w in test} == {2, 3} and all(len(w.ids) == 8 for w in test)
    everything = data.eval_windows(_Tok(), data.USER, "test", 8, 100, text)  # fewer than asked: all of them
    assert len(everything) == (2 * 32) // 8
    starts = [everything.index(w) for w in test]
    assert starts == [2, 6]  # floor((i + 1/2) * 8 / 2): spread, not the first two
    for w in everything:  # a window's passage is the one its first token came from
        own = passages[(4, 9, 14, 19)[w.passage]]
        assert (chr(w.ids[0]) in own + "\n") and w.cluster == f"texts:{w.passage}"
        assert chr(w.ids[0]) != "\n" or everything.index(w) > 0
    dev = data.eval_windows(_Tok(), data.USER, "dev", 8, 100, text, lead=[1])
    assert all(w.ids[0] == 1 and len(w.ids) == 9 for w in dev) and {w.passage for w in dev} == {0, 1}
    with pytest.raises(ValueError, match="no window of 100 tokens"):
        data.eval_windows(_Tok(), data.USER, "dev", 100, 4, text)


@pytest.mark.slow
def test_chat_template_prompt_is_the_templates_ids():
    """"Wrap in the chat template" on the built-in tokenizer (transformers 5 returns a BatchEncoding): the
    ids are the template's, the prompt inside them, the assistant turn opened at the end."""
    from transformers import AutoTokenizer

    from scdviz.models import builtin

    class Pair:
        tokenizer = AutoTokenizer.from_pretrained(builtin.producer_dir())

    tok = Pair.tokenizer
    ids = pairs.encode_prompt(Pair(), "Name three rivers.", chat=True)
    assert all(isinstance(i, int) for i in ids)
    plain = pairs.encode_prompt(Pair(), "Name three rivers.")
    text = tok.decode(ids)
    assert "Name three rivers." in text and text.rstrip().endswith("assistant")
    assert len(ids) > len(plain)
    rendered = tok.apply_chat_template([{"role": "user", "content": "Name three rivers."}],
                                       add_generation_prompt=True, tokenize=False)
    assert ids == tok(rendered, add_special_tokens=False)["input_ids"]


def test_a_pairs_card_reads_windows_spread_through_the_dev_slice(monkeypatch):
    """``drift.evaluate_pair`` (pair-info --eval, the built-in cards) measures each shipped corpus on windows spread
    through its dev slice, as the benches pick them (``eval_windows``), not the first n and never the test slice."""
    from types import SimpleNamespace

    from scdviz import drift

    seen = []

    def reuse_drift(pair, window, cont_len, item=None):
        seen.append(window)
        return {**{k: [0.0] for k in ("kl", "top1", "nll_oracle", "nll_reuse", "kl_producer", "top1_producer")},
                **{k: 0.0 for k in drift.TASK}}
    monkeypatch.setattr(drift, "reuse_drift", reuse_drift)
    monkeypatch.setattr(drift, "window_nll", lambda model, window: [1.0])
    monkeypatch.setattr(drift.qa, "prompt_item", lambda *a, **k: None)
    pair = SimpleNamespace(tokenizer=_Tok(), producer=None, consumer=None, producer_source="p", consumer_source="c")
    report = drift.evaluate_pair(pair, n_prompts=4, prompt_len=56, cont_len=8, corpora=["austen"])
    dev = data.eval_windows(_Tok(), "austen", "dev", 64, 4)
    assert seen == [w.ids for w in dev] and report["windows"] == "dev" and report["corpora"]["austen"]["n_prompts"] == 4
    assert seen != data.token_windows(_Tok(), data.passages("austen", "eval"), 64, 4)  # spread, not the first four

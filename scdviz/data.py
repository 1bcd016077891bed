"""Text passages: the shipped public-domain splits and user-supplied files.

A passage file is either ``.txt`` (passages separated by blank lines) or ``.jsonl`` (one
JSON object per line with a ``"text"`` field). A user's text (``--texts`` on every command)
is treated like a shipped corpus, so that no command measures on text another one fitted
on: a folder with ``train`` / ``calib`` / ``eval`` files is used as it is, and a single file
is split by passage, every fifth passage from the 4th on to ``calib`` and from the 5th on
to ``eval`` (60 / 20 / 20; ``text_split``). The shipped text lives in
``assets/text/<corpus>/{train,calib,eval}.txt``; the three splits never share a passage
(see assets/text/README.md for provenance and licence, and ``scdviz.prepare_text`` for
how they were built). This module does not tokenise beyond ``token_windows``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from scdviz import settings

TEXT_DIR = settings.ASSETS_DIR / "text"
SPLITS = ("train", "calib", "eval")


def corpora() -> list[str]:
    """Names of the shipped corpora (folders under assets/text/)."""
    return sorted(p.name for p in TEXT_DIR.iterdir() if (p / "eval.txt").is_file())


def split_path(corpus: str, split: str) -> Path:
    """Path of a shipped split; ValueError names what exists."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    path = TEXT_DIR / corpus / f"{split}.txt"
    if not path.is_file():
        raise ValueError(f"unknown corpus {corpus!r}; shipped: {', '.join(corpora())}")
    return path


def read_passages(path: str | Path) -> list[str]:
    """Passages of a .txt (blank-line separated) or .jsonl ("text" field) file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"text file not found: {path}")
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        passages = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "text" not in record:
                raise ValueError(f"{path}:{n}: JSON line has no 'text' field")
            passages.append(str(record["text"]).strip())
    else:
        passages = [p.strip() for p in raw.split("\n\n")]
    passages = [p for p in passages if p]
    if not passages:
        raise ValueError(f"no passages in {path}")
    return passages


def load_split(corpus: str, split: str) -> list[str]:
    """Passages of one shipped split."""
    return read_passages(split_path(corpus, split))


USER_SPLIT = {"train": (0, 1, 2), "calib": (3,), "eval": (4,)}  # passage index mod 5 -> split


def text_split(texts: str | Path, split: str) -> list[str]:
    """Passages of one split of a user's text: ``texts/<split>.txt|.jsonl`` of a folder, or every
    passage ``i`` of a file with ``i % 5`` in ``USER_SPLIT[split]`` (ValueError when it is empty)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    path = Path(texts).expanduser()
    if path.is_dir():
        found = [path / f"{split}{ext}" for ext in (".txt", ".jsonl") if (path / f"{split}{ext}").is_file()]
        if not found:
            raise ValueError(f"text folder {path} has no {split}.txt or {split}.jsonl")
        return read_passages(found[0])
    passages = [p for i, p in enumerate(read_passages(path)) if i % 5 in USER_SPLIT[split]]
    if not passages:
        raise ValueError(f"{path} has too few passages for a {split} split (passages are separated by blank "
                         "lines; every fifth one from the 4th on is calib text and from the 5th on eval text)")
    return passages


USER = "texts"  # the domain name of a user's text, wherever domains are listed


def passages(domain: str, split: str, texts: str | Path | None = None) -> list[str]:
    """One split of a domain: the user's ``texts`` for the domain named ``USER``, else a shipped corpus."""
    if domain == USER:
        if not texts:
            raise ValueError("the domain 'texts' is your text: give it with --texts")
        return text_split(texts, split)
    return load_split(domain, split)


def token_windows(tokenizer, passages: list[str], length: int, limit: int | None = None):
    """Token id lists of exactly ``length`` tokens cut from the concatenated passages.

    Passages are joined with blank lines so that a window can span a boundary, as in
    ordinary language-model training; windows do not overlap.
    """
    ids: list[int] = []
    windows: list[list[int]] = []
    for passage in passages:
        ids.extend(tokenizer(passage + "\n\n", add_special_tokens=False)["input_ids"])
        while len(ids) >= length:
            windows.append(ids[:length])
            ids = ids[length:]
            if limit is not None and len(windows) >= limit:
                return windows
    return windows


def split_prompt(window: list[int], cont_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prefix = prompt[:-1], fed = [prompt[-1]] + cont[:-1], targets = cont), each (1, n)."""
    ids = torch.tensor([window], dtype=torch.long, device="cpu")  # host-side ids; hf moves them to the model
    prompt, cont = ids[:, :-cont_len], ids[:, -cont_len:]
    fed = torch.cat([prompt[:, -1:], cont[:, :-1]], dim=1)
    return prompt[:, :-1], fed, cont

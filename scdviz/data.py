"""Text passages: the shipped public-domain splits and user-supplied files.

A passage file is either ``.txt`` (passages separated by blank lines) or ``.jsonl`` (one
JSON object per line with a ``"text"`` field). The shipped text lives in
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

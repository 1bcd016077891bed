"""Text passages: the shipped public-domain splits and user-supplied files.

A passage file is either ``.txt`` (passages separated by blank lines) or ``.jsonl`` (one
JSON object per line with a ``"text"`` field). A user's text (``--texts`` on every command)
is treated like a shipped corpus, so that no command measures on text another one fitted
on: a folder with ``train`` / ``calib`` / ``eval`` files is used as it is, and a single file
is split by passage, every fifth passage from the 4th on to ``calib`` and from the 5th on
to ``eval`` (60 / 20 / 20; ``text_split``). The shipped text lives in
``assets/text/<corpus>/{train,calib,eval}.txt``; the three splits never share a passage
(see assets/text/README.md for provenance and licence, and ``scdviz.prepare_text`` for
how they were built). This module does not tokenise beyond ``token_windows`` / ``eval_windows``.

**Slices of an eval split** (the evaluation protocol): the first ``DEV_SHARE`` of its
passages, in order, are ``dev`` (what benches read while a method is iterated on, and what
every choice may look at), the rest are ``test`` (read once per shipped artefact, by a run
from a clean tree). ``dev`` holds every passage any record or script read before the slices
existed (they all read the opening windows of each eval split: at most 6,160 tokens, 5 to 17
passages; ``tests/test_protocol_slow.py`` checks that those lie in ``dev``). ``eval_windows`` cuts a
slice into windows and takes ``n`` of them spread evenly through it (not the first ``n``);
the text between the windows taken stays unread. Each window names the passage it starts in,
so intervals can resample whole passages (``scdviz.metrics``, ``clusters``).
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from scdviz import settings

TEXT_DIR = settings.ASSETS_DIR / "text"
SPLITS = ("train", "calib", "eval")
SLICES = ("dev", "test")  # slices of an eval split (module docstring)
DEV_SHARE = 0.3  # the first 30 % of an eval split's passages are dev, the rest test


def corpora() -> list[str]:
    """Names of the shipped corpora (folders under assets/text/)."""
    return sorted(p.name for p in TEXT_DIR.iterdir() if (p / "eval.txt").is_file())


def split_path(corpus: str, split: str) -> Path:
    """Path of a shipped split (``<split>.txt``, or ``<split>.txt.gz``: the train splits are stored
    compressed); ValueError names what exists."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    for name in (f"{split}.txt", f"{split}.txt.gz"):
        path = TEXT_DIR / corpus / name
        if path.is_file():
            return path
    raise ValueError(f"unknown corpus {corpus!r}; shipped: {', '.join(corpora())}")


def read_text(path: str | Path) -> str:
    """A text file's contents (UTF-8), gunzipped when its name ends in .gz."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            return fh.read()
    return path.read_text(encoding="utf-8")


def read_passages(path: str | Path) -> list[str]:
    """Passages of a .txt (blank-line separated; .txt.gz compressed) or .jsonl ("text" field) file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"text file not found: {path}")
    raw = read_text(path)
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


def token_windows(tokenizer, passages: list[str], length: int, limit: int | None = None, spread: bool = False):
    """Token id lists of exactly ``length`` tokens cut from the concatenated passages.

    Passages are joined with blank lines so that a window can span a boundary, as in
    ordinary language-model training; windows do not overlap. ``limit``: the first
    ``limit`` windows, or with ``spread`` ``limit`` windows spread evenly through all of
    them (window ``floor((i + 1/2) * total / limit)``, as ``eval_windows`` picks).
    """
    ids: list[int] = []
    windows: list[list[int]] = []
    for passage in passages:
        ids.extend(_passage_ids(tokenizer, passage))
        while len(ids) >= length:
            windows.append(ids[:length])
            ids = ids[length:]
            if limit is not None and not spread and len(windows) >= limit:
                return windows
    if limit is not None and len(windows) > limit:
        windows = [windows[int((i + 0.5) * len(windows) / limit)] for i in range(limit)]
    return windows


def slice_passages(passages: list[str], slice_: str) -> list[tuple[int, str]]:
    """(index in the split, passage) of one slice of an eval split's passages (module docstring)."""
    if slice_ not in SLICES:
        raise ValueError(f"unknown slice {slice_!r}; use one of {', '.join(SLICES)}")
    cut = math.ceil(DEV_SHARE * len(passages))
    at = range(cut) if slice_ == "dev" else range(cut, len(passages))
    return [(i, passages[i]) for i in at]


@dataclass(frozen=True)
class Window:
    """One evaluation window: token ids, its domain and the passage it starts in (its cluster)."""

    ids: list[int]
    domain: str
    passage: int  # index of the passage (in its eval split) the window starts in

    @property
    def cluster(self) -> str:
        """The unit an interval resamples: ``domain:passage``."""
        return f"{self.domain}:{self.passage}"


def eval_windows(tokenizer, domain: str, slice_: str, length: int, n: int, texts: str | Path | None = None,
                 lead: list[int] | tuple[int, ...] = ()) -> list[Window]:
    """``n`` windows of ``len(lead) + length`` ids from one slice of ``domain``'s eval split, spread
    evenly through it: the slice is cut into every non-overlapping window (passages joined by blank
    lines, as ``token_windows`` does) and window ``floor((i + 1/2) * total / n)`` is taken for
    i < n (all of them when the slice has n or fewer). ``lead`` (e.g. a BOS id) starts each window.
    ValueError when the slice has no window of ``length`` tokens."""
    if n < 1:
        raise ValueError(f"the number of windows must be at least 1, not {n}")
    ids: list[int] = []
    starts: list[int] = []  # passage index of each id
    for index, passage in slice_passages(passages(domain, "eval", texts), slice_):
        piece = _passage_ids(tokenizer, passage)
        ids.extend(piece)
        starts.extend([index] * len(piece))
    total = len(ids) // length
    if total == 0:
        raise ValueError(f"the {slice_} slice of {domain!r}'s eval text has no window of {length} tokens "
                         f"({len(ids)} tokens in all)")
    picks = range(total) if total <= n else [int((i + 0.5) * total / n) for i in range(n)]
    return [Window(list(lead) + ids[k * length:(k + 1) * length], domain, starts[k * length]) for k in picks]


def _passage_ids(tokenizer, passage: str) -> list[int]:
    """A passage's token ids as windows are cut from them: the passage and the blank line after it."""
    return tokenizer(passage + "\n\n", add_special_tokens=False)["input_ids"]


def split_prompt(window: list[int], cont_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prefix = prompt[:-1], fed = [prompt[-1]] + cont[:-1], targets = cont), each (1, n)."""
    ids = torch.tensor([window], dtype=torch.long, device="cpu")  # host-side ids; hf moves them to the model
    prompt, cont = ids[:, :-cont_len], ids[:, -cont_len:]
    fed = torch.cat([prompt[:, -1:], cont[:, :-1]], dim=1)
    return prompt[:, :-1], fed, cont

"""Rebuild assets/text/ from Debian's public-domain text packages.

    apt-get install jargon-text bible-kjv
    python -m scdviz prepare-text

Jargon File 4.4.7 (Debian ``jargon-text``; public domain) and the King James Bible
(Debian ``bible-kjv``; public domain). Passages are assigned to splits by index
(every 10th to eval, every 10th offset by 5 to calib, the rest to train), so the
splits never share a passage. Sizes are capped so the shipped text stays under 3 MB.
This module is a maintenance step, not used at run time.
"""

from __future__ import annotations

import gzip
import re
import subprocess
from pathlib import Path

from scdviz.data import TEXT_DIR

JARGON_TXT = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
CAPS = {"train": 640_000, "calib": 150_000, "eval": 150_000}  # characters per split
BOX = re.compile("[\u2500-\u257f]")


def jargon_passages() -> list[str]:
    """Glossary paragraphs of the Jargon File, rewrapped, grouped to ~1.5k characters."""
    text = gzip.open(JARGON_TXT, "rt", encoding="utf-8").read()
    start = text.find("Glossary")
    text = text[start:] if start > 0 else text
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.splitlines()]
        if not lines or any(BOX.search(ln) for ln in lines):
            continue
        para = " ".join(ln for ln in lines if ln)
        if len(para) > 40:
            paragraphs.append(para)
    return _group(paragraphs, 1500)


def bible_passages() -> list[str]:
    """One passage per chapter of the King James Bible, verse references removed."""
    out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True)
    chapters: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        m = re.match(r"^(\w+?\d*?)(\d+):(\d+) (.*)$", line.strip())
        if m:
            chapters.setdefault(m.group(1) + m.group(2), []).append(m.group(4).strip())
    return [" ".join(verses) for verses in chapters.values()]


def _group(paragraphs: list[str], size: int) -> list[str]:
    """Join consecutive paragraphs (newline separated) until a group reaches ``size``."""
    groups, current = [], []
    for para in paragraphs:
        current.append(para)
        if sum(map(len, current)) >= size:
            groups.append("\n".join(current))
            current = []
    if current:
        groups.append("\n".join(current))
    return groups


def write_splits(name: str, passages: list[str]) -> dict[str, int]:
    """Write train/calib/eval files for one corpus; returns characters per split."""
    splits: dict[str, list[str]] = {"train": [], "calib": [], "eval": []}
    for i, passage in enumerate(passages):
        split = "eval" if i % 10 == 0 else "calib" if i % 10 == 5 else "train"
        if sum(map(len, splits[split])) + len(passage) <= CAPS[split]:
            splits[split].append(passage)
    folder = TEXT_DIR / name
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for split, items in splits.items():
        body = "\n\n".join(items) + "\n"
        (folder / f"{split}.txt").write_text(body, encoding="utf-8")
        sizes[split] = len(body)
    return sizes


def main() -> None:
    for name, fn in (("jargon", jargon_passages), ("bible", bible_passages)):
        print(name, write_splits(name, fn()))


if __name__ == "__main__":
    main()

"""Rebuild assets/text/ from freely licensed English text in Debian packages.

    apt-get install jargon-text bible-kjv dict-gcide r-cran-janeaustenr debian-handbook manpages-dev
    python -m scdviz prepare-text --maintainer

Six corpora of different registers (provenance and licences in assets/text/README.md):

* ``jargon``: Jargon File 4.4.7 glossary (``jargon-text``; public domain);
* ``bible``: King James Bible (``bible-kjv``; public domain);
* ``gcide``: dictionary entries of the GNU Collaborative International Dictionary of
  English (``dict-gcide``; GPL-2+), an evenly spaced sample across the alphabet;
* ``austen``: Jane Austen's novels, narrative and dialogue (``r-cran-janeaustenr``;
  the novels are public domain, the package MIT);
* ``handbook``: The Debian Administrator's Handbook, technical prose with its command
  examples (``debian-handbook``; GPL-2+ or CC-BY-SA-3.0);
* ``manpages``: Linux system-call manual pages (``manpages-dev``, section 2; only pages
  under the Linux-man-pages-copyleft licence), terse reference text and C code.

Passages are assigned to splits by index (every 10th to eval, every 10th offset by 5 to
calib, the rest to train), so the splits never share a passage. Sizes are capped so each
corpus stays under 1 MB. No Python documentation and no software-licence text is taken:
licence headers are skipped and any paragraph carrying licence boilerplate
(``LICENCE_MARKERS``) is dropped. This module is a maintenance step, not used at run time.
"""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import unicodedata
from html.parser import HTMLParser
from pathlib import Path

from scdviz.data import TEXT_DIR

JARGON_TXT = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
GCIDE_PACKAGE = "dict-gcide"
GCIDE_DICT = Path("/usr/share/dictd/gcide.dict.dz")
GCIDE_INDEX = Path("/usr/share/dictd/gcide.index")
AUSTEN_PACKAGE = "r-cran-janeaustenr"
AUSTEN_DATA = Path("/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb")  # read through R, below
AUSTEN_R = "library(janeaustenr); b <- austen_books(); writeLines(paste(b$book, b$text, sep = '\\t'))"
HANDBOOK_PACKAGE = "debian-handbook"
HANDBOOK_HTML = Path("/usr/share/doc/debian-handbook/html/en-US")
MANPAGES_PACKAGE = "manpages-dev"
MANPAGES_DIR = Path("/usr/share/man/man2")
MANPAGES_LICENCE = "Linux-man-pages-copyleft"
CAPS = {"train": 640_000, "calib": 150_000, "eval": 150_000}  # characters per split
BOX = re.compile("[\u2500-\u257f]")
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"'])|(?<=[.!?]--))\s+(?=[\"'A-Z])")
# A paragraph containing any of these (case-insensitive) is dropped from the new corpora.
LICENCE_MARKERS = (
    "general public license",
    "free documentation license",
    "permission is hereby granted",
    "permission is granted to",
    "the software is provided",
    "redistribution and use in source",
    "without any warranty",
    "merchantability",
    "creative commons",
    "licensed under",
    "python software foundation",
    ">>> ",
)


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


# ---------------------------------------------------------------- GCIDE (dictionary)

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
# GCIDE's ASCII codes for accented letters and symbols (those left after pronunciations go)
_MARKS = {"'": "\u0301", "`": "\u0300", "^": "\u0302", '"': "\u0308", "~": "\u0303", ",": "\u0327", "=": "\u0304"}
_NAMED = dict(
    item.split(":", 1)
    for item in (
        "ae:æ AE:Æ oe:œ OE:Œ aum:ä eth:ð thorn:þ yogh:ȝ deg:° sect:§ para:¶ root:√ cuberoot:∛ imac:ī =ae:ǣ =oo:oo "
        "frac12:½ frac13:⅓ frac14:¼ frac23:⅔ frac34:¾ min:′ sec:″ prime:′ bprime:″ sharp:♯ flat:♭ natural:♮ "
        "pounds:£ times:× middot:· div:÷ divby:÷ ldquo:“ rdquo:” ldqo:“ rdqo:” asl: cre: ddot: hand: pause:"
    ).split()
)
_NAMED["nbsp"] = " "
_NAMED.update(
    zip(
        "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
        "upsilon phi chi psi omega".split(),
        "αβγδεζηθικλμνξοπρστυφχψω",
    )
)
_GCIDE_SOURCE = re.compile(r"\s*\[[^\]\n]*(?:Webster|WordNet|PJC|Suppl\.)[^\]\n]*\]")


def _b64(s: str) -> int:
    n = 0
    for ch in s:
        n = n * 64 + _B64.index(ch)
    return n


def _gcide_code(m: re.Match) -> str:
    code = m.group(1)
    if code in _NAMED:
        return _NAMED[code]
    if len(code) == 2 and code[0] in _MARKS and code[1].isalpha():
        return unicodedata.normalize("NFC", code[1] + _MARKS[code[0]])
    if len(code) == 2 and code[1] == "^" and code[0].isalpha():  # breve (short vowel)
        return code[0]
    if len(code) in (2, 3) and code[0] in "-.*" and code[1:].isalpha():
        return code[1:]
    if code.isdigit():  # superscript sense numbers
        return ""
    return m.group(0)


def gcide_clean(entry: str) -> str:
    # a few entries end "[1913 Webster] Nextword": a stray start of the following entry
    entry = re.sub(r"(\[[^\]\n]*(?:Webster|WordNet|PJC)[^\]\n]*\])[ \t]+[^\n\[]+\s*$", r"\1", entry)
    entry = _GCIDE_SOURCE.sub("", entry)
    entry = re.sub(r"\\[^\\\n]*\\\s*", "", entry)  # \Co*ag"u*late\ headword syllabification
    entry = re.sub(r"\s*\([^()\n]*(?:\[[^\]\s]{1,6}\]|`)[^()\n]*\)", "", entry)  # pronunciations
    entry = re.sub(r"\[([^\]\s]{1,7})\]", _gcide_code, entry)
    entry = re.sub(r"\[[^\[\]]*\?[^\[\]]*\]", "", entry)  # etymologies whose Greek/Hebrew was lost
    entry = re.sub(r"\s*\((?=[^()\n]*\?)[^()\n]*\)", "", entry)  # pronunciations with lost letters
    entry = re.sub(r"\s*\([^\s()]*[\"*`][^\s()]*\)", "", entry)  # pronunciations, one respelling
    entry = re.sub(r"\{([^{}]*)\}", r"\1", entry)  # cross-reference braces
    entry = re.sub(r"\S*`\S*", lambda m: re.sub("[`'\"]", "", m.group(0)), entry)  # Greek transliteration
    entry = re.sub(r"(?<=[A-Za-z])[*\"](?=[A-Za-z])", "", entry)  # Ex*haust"ive*ly run-on forms
    entry = re.sub(r"(?<=[A-Za-z])\^", "", entry)  # circumflex of transliterated Greek (nh^ma)
    entry = entry.replace("{", "").replace("}", "")  # unbalanced cross-reference braces
    blocks, current = [], []
    for line in entry.splitlines():
        if line.strip():
            current.append(line.strip())
        elif current:
            blocks.append(" ".join(current))
            current = []
    if current:
        blocks.append(" ".join(current))
    text = "\n".join(re.sub(r"\s+([,.;:])", r"\1", re.sub(r"[ \t]+", " ", b)).strip() for b in blocks)
    return text.replace(" ,", ",")


def gcide_passages(target: int = 1_550_000) -> list[str]:
    """Dictionary entries of GCIDE, every k-th entry (so the sample spans A to Z), ~1.5k groups."""
    _require(GCIDE_DICT, GCIDE_PACKAGE)
    raw = gzip.open(GCIDE_DICT, "rb").read().decode("cp1252")  # ASCII save three cp1252 bytes
    spans = set()
    for line in GCIDE_INDEX.read_text(encoding="utf-8").splitlines():
        headword, offset, length = line.split("\t")
        if not headword.startswith("00"):  # 00-database-* entries: metadata and the licence notice
            spans.add((_b64(offset), _b64(length)))
    entries = [gcide_clean(raw[o : o + n]) for o, n in sorted(spans)]
    entries = [e for e in entries if len(e) > 40 and "\\" not in e]
    total = sum(map(len, entries))
    step = max(1, round(total / target))
    sample = [piece for e in entries[::step] for piece in split_long(e)]
    return _unique(_group(drop_boilerplate(sample), 1500))


# ---------------------------------------------------------------- Jane Austen (novels)


def austen_passages(target: int = 1_400_000) -> list[str]:
    """Paragraphs of Austen's six novels, headings dropped, grouped to ~1.5k within each book; every
    k-th group is kept so that all six novels reach every split."""
    _require(AUSTEN_DATA, AUSTEN_PACKAGE)
    out = subprocess.run(["Rscript", "-e", AUSTEN_R], capture_output=True, text=True, check=True)
    books: dict[str, list[list[str]]] = {}
    for line in out.stdout.splitlines():
        book, _, text = line.partition("\t")
        paras = books.setdefault(book, [[]])
        if text.strip():
            paras[-1].append(text.strip())
        elif paras[-1]:
            paras.append([])
    heading = re.compile(
        r"^(?:CHAPTER|Chapter|VOLUME|Volume)\s+[IVXLC\d]+\.?$|^by Jane Austen$|^\(\d{4}\)$|^THE END$|^Finis$"
    )
    passages = []
    for paras in books.values():
        kept = []
        for lines in paras:
            para = " ".join(lines).replace("_", "")
            if not para or heading.match(para) or (para.isupper() and len(para) < 80):
                continue
            if re.fullmatch(r"[* ]+", para) or (para.startswith("[") and para.endswith("]")):  # breaks, editors' notes
                continue
            kept += split_long(re.sub(r"\s+", " ", para))
        passages += _group(drop_boilerplate(kept), 1500)
    step = max(1, round(sum(map(len, passages)) / target))
    return _unique(passages[::step])


# ---------------------------------------------------------------- Debian Administrator's Handbook


class _HandbookParser(HTMLParser):
    """Blocks of one DocBook HTML page: paragraphs, titles and (short) program listings."""

    SKIP = {"navheader", "navfooter", "toc", "legalnotice", "docnav", "indexterm", "table", "informaltable"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str | None] = []  # per open element: None, "skip", "block" or "pre"
        self.blocks: list[tuple[str, str]] = []
        self.buf: list[str] | None = None
        self.kind = ""
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("br", "img", "meta", "link", "hr", "col", "input", "area"):
            return
        cls = (dict(attrs).get("class") or "").split()
        role = None
        if tag in ("table", "script", "style") or self.SKIP & set(cls):
            role, self.skip = "skip", self.skip + 1
        elif tag == "pre" and not self.skip:
            self._flush()
            role, self.buf, self.kind = "pre", [], "pre"
        elif (
            self.buf is None
            and not self.skip
            and ((tag == "div" and "para" in cls) or re.fullmatch(r"h[1-6]", tag) or (tag == "p" and "title" in cls))
        ):
            role, self.buf, self.kind = "block", [], "para"
        self.stack.append(role)

    def handle_endtag(self, tag):
        if tag in ("br", "img", "meta", "link", "hr", "col", "input", "area") or not self.stack:
            return
        role = self.stack.pop()
        if role == "skip":
            self.skip -= 1
        elif role in ("block", "pre"):
            self._flush()
            if role == "pre":  # text after a listing inside the same paragraph
                parent = next((r for r in reversed(self.stack) if r == "block"), None)
                if parent:
                    self.buf, self.kind = [], "para"

    def handle_data(self, data):
        if self.buf is not None and not self.skip:
            self.buf.append(data)

    def _flush(self):
        if self.buf is not None:
            text = "".join(self.buf)
            if self.kind == "para":
                text = re.sub(r"\s+", " ", text).strip()
            if text.strip():
                self.blocks.append((self.kind, text))
        self.buf = None


def _handbook_pages() -> list[Path]:
    """Pages in reading order, following each page's Next link from the preface."""
    pages, seen, page = [], set(), "preface.html"
    while page and page not in seen:
        seen.add(page)
        pages.append(HANDBOOK_HTML / page)
        m = re.search(r'accesskey="n" href="([^"#]+)"', pages[-1].read_text(encoding="utf-8"))
        page = m.group(1) if m else None
    return pages


def handbook_passages() -> list[str]:
    """Paragraphs, section titles and short command/config listings of the Handbook, ~1.5k groups."""
    _require(HANDBOOK_HTML / "preface.html", HANDBOOK_PACKAGE)
    paragraphs = []
    for page in _handbook_pages():
        parser = _HandbookParser()
        parser.feed(page.read_text(encoding="utf-8"))
        for kind, text in parser.blocks:
            if kind == "pre":
                lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
                body = "\n".join(lines)
                columnar = sum(bool(re.search(r"\S {3,}\S", ln.strip())) for ln in lines)
                if (
                    lines
                    and len(body) <= 2500
                    and len(lines) <= 60
                    and max(map(len, lines)) <= 160
                    and columnar <= len(lines) / 2  # not a table of command output
                    and not BOX.search(body)
                ):
                    paragraphs.append(body)
            elif not re.match(r"^(Figure|Table) \d+\.\d+\.", text):
                paragraphs.append(text)
    return _unique(_group(drop_boilerplate(paragraphs), 1500))


# ---------------------------------------------------------------- Linux man pages, section 2


def _manpage_licence(path: Path) -> str:
    head = gzip.open(path, "rt", encoding="utf-8", errors="replace").read(4000)
    m = re.search(r"SPDX-License-Identifier:\s*(\S+)", head)
    return m.group(1) if m else ""


def _render_manpage(path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MAN_KEEP_FORMATTING", "MANPAGER", "PAGER")}
    env.update(MANWIDTH="80", LC_ALL="C.UTF-8")
    out = subprocess.run(["man", "--nh", "--nj", "-l", str(path)], capture_output=True, text=True, env=env, check=True)
    return out.stdout


_MAN_DROP = {"LIBRARY", "ATTRIBUTES", "SEE ALSO", "COLOPHON", "STANDARDS", "VERSIONS", "HISTORY"}


def manpage_paragraphs(rendered: str, seen: set[str]) -> list[str]:
    """Headings, reflowed prose and verbatim code of one rendered page; prose paragraphs already
    in ``seen`` (boilerplate shared by many pages) are left out, as are headings left empty."""
    lines = rendered.splitlines()[1:-1]  # drop the running header and footer
    units: list[tuple[bool, bool, str]] = []  # (is code, is heading, text)
    section, block, program = "", [], False

    def flush():
        nonlocal block, program
        rows = [ln.rstrip() for ln in block if ln.strip()]
        block = []
        if not rows or section in _MAN_DROP or any(BOX.search(r) for r in rows):
            return
        indents = [len(r) - len(r.lstrip()) for r in rows]
        base = min(indents)
        codeish = (
            section == "SYNOPSIS"
            or program
            or (section == "EXAMPLES" and any(re.search(r"[;{}]$|^\s*#|^\s*\$ |^\s*/?\*", r) for r in rows))
        )
        if section == "EXAMPLES" and rows[0].strip() == "Program source" and len(rows) == 1:
            program = True  # the rest of the section is a C program
            units.append((False, True, "Program source"))
            return
        if codeish:
            text = "\n".join(r[min(base, 7) :] for r in rows)  # keep the code's own indentation
        elif len(rows) > 2 and sum(bool(re.search(r"\S {3,}\S", r.strip())) for r in rows) > len(rows) / 2:
            return  # a table
        elif len(rows) > 1 and indents[0] < indents[1] and len(rows[0].strip()) < 40 and "  " not in rows[0].strip():
            # a hanging tag alone on its line (an option, a flag); "EBADF  fd is..." is plain prose
            text = rows[0].strip() + "\n" + join_rows(rows[1:])
        elif len(rows) == 1 and indents[0] < 7 and len(rows[0].strip()) < 60:  # a subsection title
            units.append((False, True, rows[0].strip()))
            return
        else:
            text = join_rows(rows)
        if not codeish:
            text = re.sub(r"[ \t]+", " ", text)
        units.append((codeish, False, text))

    for line in lines:
        if line and not line[0].isspace():  # a section heading
            flush()
            section, program = line.strip(), False
            if section not in _MAN_DROP:
                units.append((False, True, section))
        elif not line.strip():
            flush()
        else:
            block.append(line)
    flush()
    kept = []
    for code, heading, text in units:
        if not (code or heading) and text in seen:  # code is kept whole, even a repeated "}"
            continue
        seen.add(text)
        kept.append((heading, text))
    # keep a heading only if some text follows it before the next heading
    return [t for i, (h, t) in enumerate(kept) if not h or (i + 1 < len(kept) and not kept[i + 1][0])]


def join_rows(rows: list[str]) -> str:
    """Rewrapped lines joined; a line ending in a hyphen ("Linux-") joins the next without a space."""
    text = ""
    for row in (r.strip() for r in rows):
        text += row if not text or re.search(r"[A-Za-z]-$", text) and row[:1].islower() else " " + row
    return text


def manpages_passages() -> list[str]:
    """Section-2 manual pages under Linux-man-pages-copyleft, shared boilerplate kept once."""
    _require(MANPAGES_DIR / "read.2.gz", MANPAGES_PACKAGE)
    pages = sorted(
        p for p in MANPAGES_DIR.glob("*.2.gz") if not p.is_symlink() and _manpage_licence(p) == MANPAGES_LICENCE
    )  # a symlink is another name for a page already taken
    seen: set[str] = set()
    paragraphs = []
    for path in pages:
        paragraphs += manpage_paragraphs(_render_manpage(path), seen)
    return _unique(_group(drop_boilerplate(paragraphs), 1500))


# ---------------------------------------------------------------- shared helpers


def _require(path: Path, package: str) -> None:
    if not path.exists():
        raise SystemExit(f"{path} not found: apt-get install {package}")


_LICENCE_TALK = re.compile(r"\b(licen[cs]e[sd]?|copyleft|gpl|dfsg)\b", re.IGNORECASE)


def drop_boilerplate(paragraphs: list[str]) -> list[str]:
    """Paragraphs without licence boilerplate, without talk about licences (the Handbook's DFSG
    and licensing chapters paraphrase licence terms) and without Python-documentation markers."""
    return [p for p in paragraphs if not any(m in p.lower() for m in LICENCE_MARKERS) and not _LICENCE_TALK.search(p)]


def split_long(text: str, limit: int = 2000, size: int = 1500) -> list[str]:
    """Text longer than ``limit`` cut at line, then sentence, ends into pieces of about ``size``."""
    if len(text) <= limit:
        return [text]
    units = []  # (separator before it, text)
    for line in text.split("\n"):
        sentences = _SENTENCE_END.split(line) if len(line) > limit else [line]
        units += [("\n" if i == 0 else " ", sentence) for i, sentence in enumerate(sentences)]
    pieces, current = [], ""
    for sep, unit in units:
        if current and len(current) + len(unit) > size:
            pieces.append(current)
            current = unit
        else:
            current = current + sep + unit if current else unit
    if current:
        pieces.append(current)
    return pieces


def _unique(passages: list[str]) -> list[str]:
    """Passages in order, each exact duplicate after its first occurrence removed."""
    seen: set[str] = set()
    out = []
    for p in passages:
        p = p.strip()
        if p and p not in seen:
            seen.add(p)
            out.append(p)
    return out


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
        if split == "train":  # the largest split, stored compressed (byte-for-byte reproducible: no name, no time)
            (folder / "train.txt.gz").write_bytes(gzip.compress(body.encode("utf-8"), compresslevel=9, mtime=0))
            (folder / "train.txt").unlink(missing_ok=True)
        else:
            (folder / f"{split}.txt").write_text(body, encoding="utf-8")
        sizes[split] = len(body)
    return sizes


CORPORA = {
    "jargon": jargon_passages,
    "bible": bible_passages,
    "gcide": gcide_passages,
    "austen": austen_passages,
    "handbook": handbook_passages,
    "manpages": manpages_passages,
}


def main(names: list[str] | None = None) -> None:
    for name in names or CORPORA:
        print(name, write_splits(name, CORPORA[name]()))


if __name__ == "__main__":
    main()

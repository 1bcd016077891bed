"""The runs folder: where every artefact a user makes goes, from the CLI and from the app.

    <work dir>/runs/<kind>/<name>/     work dir: SCDVIZ_WORK, else SCDVIZ_CACHE, else the platform cache

Kinds: ``calibrations`` (SCD), ``policies`` (DistillCache), ``specialists`` (LoRA adapters from
``finetune``), ``bench`` (a record, its config and its figures), and ``distil-work`` / ``fit-work`` (the
checkpoints of ``distil`` and ``fit-student``, where a stopped fit resumes). The repository's
``assets/`` is written only when a maintainer asks for it by name (``--maintainer``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from scdviz import settings
from scdviz.errors import UserError

KINDS = ("calibrations", "policies", "specialists", "bench", "distil-work", "fit-work")
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def run_name(value) -> str:
    """A run name usable as one folder name: letters, digits, ``_.-``, not starting with a dot."""
    name = (value or "").strip() if isinstance(value, str) else value
    if not isinstance(name, str) or not name:
        raise UserError("the run name is empty; use letters, digits, '-', '_' or '.' (e.g. my-run-1)")
    if not RUN_NAME.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 40 else repr(name)[:37] + "..."
        raise UserError(f"run name {shown} is not allowed: use 1-64 letters, digits, '-', '_' or '.', "
                        "starting with a letter or digit (no path separators, no '.' or '..')")
    return name


def root() -> Path:
    """Parent of every run of local use (hosted visitors' runs live in their session folders)."""
    return settings.work_dir() / "runs"


def auto_name(prefix: str) -> str:
    """``prefix-YYYYmmdd-HHMMSS`` (UTC), for runs the user did not name."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


def folder(kind: str, name: str | None, parent: Path | None = None) -> Path:
    """``<runs>/<kind>/<name>`` (not created); the name is checked to be one plain folder name."""
    if kind not in KINDS:
        raise ValueError(f"unknown run kind {kind!r}; use one of {', '.join(KINDS)}")
    return (parent or root()) / kind / run_name(name)


def new(kind: str, name: str | None, parent: Path | None = None) -> Path:
    """Create and return a run folder; UserError when one of that name exists and holds anything."""
    path = folder(kind, name, parent)
    if path.exists() and any(path.iterdir()):
        raise UserError(f"a {kind[:-1]} run named {path.name!r} already exists ({path}); choose another name")
    path.mkdir(parents=True, exist_ok=True)
    return path


def bench_records(parent: Path | None = None) -> list[Path]:
    """Bench records saved in the runs folder, newest first."""
    base = (parent or root()) / "bench"
    found = base.glob("*/record.json") if base.is_dir() else []
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)

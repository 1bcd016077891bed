"""One visitor's artefacts: the calibrations and policies they made or loaded, and their folder.

A ``Session`` lives in the app's ``gr.State`` (one per open page), never in a module
global, so one visitor's calibration never replaces another's. Shipped artefacts are read
from ``assets/`` and never written.

Where runs go:
  local use    ``$SCDVIZ_WORK/runs/<name>`` (kept; a name already used is refused)
  hosted mode  ``$SCDVIZ_WORK/sessions/<id>/runs/<name>``, at most SCDVIZ_MAX_SESSION_RUNS
               of them, deleted with the session (page closed, or idle past SCDVIZ_SESSION_TTL)
               and at the next start of the app.
``SCDVIZ_WORK`` defaults to ``SCDVIZ_CACHE``. Scratch files (CSV exports) go to
``$SCDVIZ_WORK/sessions/<id>/scratch`` in both modes
and are deleted with the session. This module imports neither torch nor gradio.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from scdviz import runs, settings
from scdviz.errors import UserError


def sessions_root() -> Path:
    """Parent of every session folder."""
    return settings.work_dir() / "sessions"


def folder_id(key: str) -> str:
    """The folder name for a page's session key (gradio's session hash, which a client chooses):
    hashed, so no key can name a path."""
    return hashlib.sha256(str(key).encode()).hexdigest()[:16]


def remove_folder_of(key: str) -> None:
    """Delete the folder of the page with this session key (the app calls it when the page closes)."""
    shutil.rmtree(sessions_root() / folder_id(key), ignore_errors=True)


def clean_stale() -> int:
    """Remove session folders left by an earlier process (the app calls this at start); returns how many."""
    root = sessions_root()
    if not root.is_dir():
        return 0
    stale = [p for p in root.iterdir() if p.is_dir()]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return len(stale)


@dataclass
class Session:
    """What one visitor made or loaded; lives in gr.State."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    calibrations: dict = field(default_factory=dict)  # (producer, consumer) -> the folder of one made/loaded here
    policies: dict = field(default_factory=dict)  # method name -> the file of a policy or scorer made here
    runs: list = field(default_factory=list)  # folders written for this visitor, oldest first
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __deepcopy__(self, memo):  # gradio copies state values; a session is one visitor's, shared by reference
        return self

    def bind(self, key: str | None) -> Session:
        """Name this session's folder after the page's session key, so closing the page can remove it
        (``remove_folder_of``); only before anything was written."""
        if key and not self.runs and not self.folder.exists():
            self.id = folder_id(key)
        return self

    @property
    def folder(self) -> Path:
        """This session's own folder (scratch, and runs in hosted mode)."""
        return sessions_root() / self.id

    def scratch(self) -> Path:
        """A folder for throw-away files of this session (created on demand)."""
        path = self.folder / "scratch"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def new_run(self, name, kind: str) -> Path:
        """A fresh folder ``runs/<kind>/<name>`` (scdviz.runs): validated, unique, and bounded in hosted
        mode, where it lies in this session's folder."""
        path = runs.folder(kind, name, self.folder / "runs" if settings.hosted() else None)
        name = path.name
        with self._lock:
            if settings.hosted() and len(self.runs) >= settings.max_session_runs():
                raise UserError(f"this hosted demo keeps at most {settings.max_session_runs()} runs per visitor "
                                f"and you have made {len(self.runs)}; reload the page to start a new session")
            if path in self.runs or path.exists():
                raise UserError(f"a run named {name!r} already exists ({path}); choose another name")
            path.mkdir(parents=True)
            self.runs.append(path)
        return path

    def discard_run(self, path: Path) -> None:
        """Remove a run folder this session made (a cancelled job's) and free its place."""
        shutil.rmtree(path, ignore_errors=True)
        with self._lock:
            if path in self.runs:
                self.runs.remove(path)

    def close(self) -> None:
        """Forget this visitor's artefacts and delete the session folder (hosted runs included)."""
        self.calibrations.clear()
        self.policies.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


def open_session() -> Session:
    """A new visitor's Session (gr.State calls this once per page load)."""
    return Session()

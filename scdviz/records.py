"""Benchmark records: one type for both benches, written as strict JSON.

A ``BenchRecord`` is what ``python -m scdviz bench scd|evict --out FILE`` writes and what
the Results tab opens: ``kind`` ("scd" or "evict") says which bench made it (nobody
guesses from column names), ``settings`` are the full settings of the run (sources and
config, as the CLI parsed them; the run's ``config.toml`` reruns it), ``seed`` the seed,
``versions`` the packages, git commit, hardware and device it ran on, ``seconds`` its wall
time, ``rows`` the bench's rows. NaN and infinities become JSON null. A file named ``*.json.gz`` holds
the same JSON gzipped (shipped records that would not otherwise fit the tree; written byte for byte the
same every time).
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

KINDS = ("scd", "evict", "ttft", "cost")
FORMAT = "scdviz-bench/1"
SUFFIXES = (".json", ".json.gz")  # a record's file name ends in one of these
MAX_UNPACKED = 64 * 2**20  # bytes a gzipped record may unpack to (a shipped one is under 1 MB)
_PACKAGES = ("torch", "transformers", "kvpress", "peft", "safetensors", "gradio")


@dataclass
class BenchRecord:
    """One benchmark run."""

    kind: str  # one of KINDS
    settings: dict  # sources and config of the run
    seed: int  # the seed the run set
    rows: list[dict]  # the bench's rows
    versions: dict = field(default_factory=dict)  # python, packages, scdviz, device
    created: str = ""  # UTC time written
    format: str = FORMAT  # layout of this file
    note: str = ""  # anything done to the file after the run (e.g. a label corrected), said plainly
    seconds: float | None = None  # wall time of the run

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown bench kind {self.kind!r}; use one of {KINDS}")


def versions(device: str = "") -> dict:
    """Python, scdviz and package versions (None for a package not installed), the device, the
    git commit of the code this process loaded (``loaded_commit``: None outside a checkout; ``+dirty`` with
    uncommitted changes) and the hardware."""
    from scdviz import __version__

    out: dict = {"python": platform.python_version(), "scdviz": __version__, "device": device,
                 "git_commit": loaded_commit(), "hardware": hardware(device)}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


@functools.cache
def loaded_commit() -> str | None:
    """The commit of the code this process runs: ``git_commit()`` the first time it is asked (the CLI asks as it
    starts, a test-slice check before anything is measured), never again, so a checkout edited or committed while
    a long run goes on does not re-stamp what the run measured (``versions``)."""
    return git_commit()


def git_commit() -> str | None:
    """The checkout's commit, ``+dirty`` when tracked files changed; None when not run from a git checkout."""
    import subprocess

    from scdviz import settings

    if not (settings.REPO_DIR / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=settings.REPO_DIR, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=settings.REPO_DIR,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def hardware(device: str = "") -> dict:
    """CPU, cores, torch threads and, on CUDA, the GPU's name."""
    import os

    import torch

    out = {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
           "system": platform.system(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def run_info(settings_: dict, seed: int | None, device: str, seconds: float, command: str) -> dict:
    """What a calibrate / train / finetune run writes beside its results (run.json): the same
    provenance a BenchRecord carries."""
    return finite({"command": command, "settings": settings_, "seed": seed, "versions": versions(device),
                   "seconds": round(seconds, 1), "created": _now()})


def finite(obj):
    """NaN / inf -> None, tuples -> lists, recursively, so the JSON is strict."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (list, tuple)):
        return [finite(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    return obj


def make(kind: str, settings: dict, seed: int, rows: list[dict], device: str = "",
         seconds: float | None = None) -> BenchRecord:
    """A record of a run just made (versions, time and wall time filled in)."""
    return BenchRecord(kind, settings, seed, rows, versions(device), _now(),
                       seconds=None if seconds is None else round(seconds, 1))


def _now() -> str:
    """UTC time as the records write it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def dumps(obj: dict) -> str:
    """Strict JSON (no NaN) of a record: one line per top-level field and one per row, so records
    stay small and a rerun's diff shows which rows changed."""
    def one(value) -> str:
        return json.dumps(value, allow_nan=False)

    fields = []
    for key, value in obj.items():
        if key == "rows" and isinstance(value, list):
            body = "[\n" + ",\n".join("  " + one(row) for row in value) + "\n ]" if value else "[]"
        else:
            body = one(value)
        fields.append(f" {one(key)}: {body}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


def is_record_name(name: str) -> bool:
    """Whether a file name is a record's (``SUFFIXES``)."""
    return name.lower().endswith(SUFFIXES)


def without_suffix(name: str) -> str:
    """``name`` (a file name or a path as text) without its record suffix, ``.json`` or ``.json.gz``."""
    return next((name[: -len(s)] for s in sorted(SUFFIXES, key=len, reverse=True) if name.lower().endswith(s)), name)


def stem(path: str | Path) -> str:
    """A record file's name without ``.json`` or ``.json.gz`` (its ``.toml`` config is ``stem + ".toml"``)."""
    name = Path(path).name
    return without_suffix(name) if is_record_name(name) else Path(path).stem


def _gzipped(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


def write(record: BenchRecord, path: str | Path) -> Path:
    """Write strict JSON (no NaN), laid out by ``dumps``; gzipped when the name ends in ``.gz`` (no time
    stamp in the gzip header: the same record gives the same bytes)."""
    path = Path(path)
    text = dumps(finite(asdict(record)))
    if _gzipped(path):
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)
    return path


def _unpacked(path: Path) -> bytes:
    """A gzipped file's content; ValueError for one that is not gzip or unpacks past ``MAX_UNPACKED``."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read(MAX_UNPACKED + 1)
    except (gzip.BadGzipFile, EOFError, OSError) as err:
        raise ValueError(f"{path.name} is not a gzipped file: {err}") from None
    if len(data) > MAX_UNPACKED:
        raise ValueError(f"{path.name} unpacks to more than {MAX_UNPACKED // 2**20} MB: not a benchmark record")
    return data


def from_json(obj, name: str = "the file") -> BenchRecord:
    """A record from parsed JSON; ValueError saying what is missing."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"{name} is not a scdviz benchmark record (expected a JSON object with format {FORMAT!r}, "
                         "from `python -m scdviz bench ... --out FILE`)")
    missing = [k for k in ("kind", "settings", "seed", "rows") if k not in obj]
    if missing:
        raise ValueError(f"{name}: benchmark record without {', '.join(missing)}")
    rows = obj["rows"]
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{name}: the record has no rows")
    return BenchRecord(obj["kind"], obj["settings"], obj["seed"], rows, obj.get("versions") or {},
                       obj.get("created", ""), obj["format"], obj.get("note", ""), obj.get("seconds"))


def read(path: str | Path) -> BenchRecord:
    """Read a record file; ValueError for a file that is not one."""
    path = Path(path)
    try:
        obj = json.loads((_unpacked(path) if _gzipped(path) else path.read_bytes()).decode())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path.name} is not a JSON file: {err}") from None
    except RecursionError:  # json nests one Python call per level
        raise ValueError(f"{path.name} nests its JSON too deeply to be a benchmark record") from None
    return from_json(obj, path.name)

"""Saved artefacts (SCD calibrations, DistillCache policies): one versioned file format, one identity check.

An artefact is a single safetensors file: its tensors, and in the safetensors metadata one
JSON header ``{"kind", "version", "scdviz", "identity", "config", "meta"}``. ``kind`` says
what it is, ``version`` the layout of its tensors and header (``load`` refuses a version it
cannot read, saying which), ``identity`` the models it was made with (sources, weight
fingerprints, tokenizer hash), ``config`` the settings that made it (read back with
``scdviz.config.from_dict``) and ``meta`` whatever else it measured. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from scdviz import __version__
from scdviz.models import hf
from scdviz.models.pair import PairError

# kind -> the version this code writes
VERSIONS = {"scd-calibration": 4, "distillcache-policy": 2, "distillcache-student": 1}
# kind -> the versions it reads (scd-calibration 4: a trained correction stage's factors as int8 rows; 3 had
# them in float32, which 4's reader reads as they are: an older reader would take int8 rows for floats)
READS = {"scd-calibration": (3, 4), "distillcache-policy": (2,), "distillcache-student": (1,)}
_KEY = "scdviz"  # the safetensors metadata key holding the header


@dataclass
class Artefact:
    """A loaded artefact: tensors (on the host) and its header."""

    kind: str  # one of VERSIONS
    version: int  # layout version it was written with
    tensors: dict[str, torch.Tensor]  # name -> tensor
    identity: dict  # the models it was made with
    config: dict  # the settings that made it
    meta: dict  # other recorded facts
    path: Path  # where it was read from


def fingerprint(model) -> str:
    """A short hash of every layer's k_proj / v_proj weight sums (tells specialists apart)."""
    sums = []
    for idx in range(hf.n_layers(model)):
        wk, wv = hf.kv_weights(model, idx)
        sums += [f"{float(wk.detach().double().sum()):.4e}", f"{float(wv.detach().double().abs().sum()):.6e}"]
    return hashlib.sha256(",".join(sums).encode()).hexdigest()[:12]


def save(path: str | Path, kind: str, tensors: dict[str, torch.Tensor], identity: dict, config: dict,
         meta: dict | None = None) -> Path:
    """Write one artefact file (tensors moved to the host, contiguous)."""
    if kind not in VERSIONS:
        raise ValueError(f"unknown artefact kind {kind!r}; use one of {sorted(VERSIONS)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"kind": kind, "version": VERSIONS[kind], "scdviz": __version__, "identity": identity,
              "config": config, "meta": meta or {}}
    host = {k: v.detach().to(hf.HOST).contiguous() for k, v in tensors.items()}
    save_file(host, str(path), metadata={_KEY: json.dumps(header, allow_nan=False)})
    return path


def int8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix as int8 with one fp16 scale per row (symmetric, absmax): half of fp16's bytes."""
    scale = (t.float().abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
    return (t.float() / scale).round().clamp(-127, 127).to(torch.int8), scale.half()


def from_int8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 matrix of ``int8_rows``."""
    return q.float() * scale.float()


def kind_of(path: str | Path) -> str | None:
    """The kind a safetensors file's scdviz header names (None without one), its tensors unread."""
    with safe_open(str(path), "pt") as fh:
        raw = (fh.metadata() or {}).get(_KEY)
    try:
        return None if raw is None else json.loads(raw).get("kind")
    except (json.JSONDecodeError, AttributeError):
        return None


def load(path: str | Path, kind: str) -> Artefact:
    """Read an artefact of ``kind``; ValueError saying what is wrong with a missing, foreign,
    damaged or other-version file."""
    path = Path(path)
    what = kind.replace("-", " ")
    if not path.is_file():
        raise ValueError(f"no {what} at {path} (file missing)")
    try:
        with safe_open(str(path), "pt") as fh:
            raw = (fh.metadata() or {}).get(_KEY)
        tensors = load_file(str(path))
    except Exception as err:  # noqa: BLE001 - safetensors raises several types for a damaged file
        first = str(err).splitlines()[0][:200] if str(err) else ""
        raise ValueError(f"{path} is not a readable safetensors file ({type(err).__name__}: {first})") from None
    if raw is None:
        raise ValueError(f"{path} has no scdviz header: it was not written by scdviz (or by a version before "
                         f"format {VERSIONS[kind]}); make it again")
    try:
        header = json.loads(raw)
        got_kind, version = header["kind"], int(header["version"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: damaged scdviz header ({type(err).__name__}: {err})") from None
    if got_kind != kind:
        raise ValueError(f"{path} holds a {got_kind.replace('-', ' ')}, not a {what}")
    if version not in READS[kind]:
        reads = " or ".join(map(str, READS[kind]))
        raise ValueError(f"{path} is a {what} of format {version}; this scdviz reads format {reads} "
                         f"(written by scdviz {header.get('scdviz', '?')}); make it again")
    return Artefact(kind, version, tensors, header.get("identity") or {}, header.get("config") or {},
                    header.get("meta") or {}, path)


def check_identity(saved: dict, now: dict, labels: dict[str, str], what: str, describe, hint: str) -> None:
    """PairError listing each ``labels`` key whose saved value differs from ``now``.

    what: the artefact and where it is ("the SCD calibration in FOLDER"); describe(identity)
    names the models of an identity; hint: how to fix it.
    """
    bad = [f"{label}: saved {saved.get(key)!r}, loaded {now.get(key)!r}" for key, label in labels.items()
           if saved.get(key) != now.get(key)]
    if bad:
        raise PairError(f"{what} was made for {describe(saved)}, not for the loaded {describe(now)}:\n- "
                        + "\n- ".join(bad) + f"\n{hint}")

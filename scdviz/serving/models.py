"""The safetensors folders an engine loads: the built-in producer and a built-in specialist, merged.

Runs in the **project's** environment (transformers 5.2 + peft), never in the engine's venv: the producer's
folder is the one ``scdviz.models.builtin`` already writes from the GGUF (``producer_dir``); a specialist
(a shipped LoRA adapter, ``assets/adapters/NAME``) is loaded exactly as ``load_pair`` loads it (the producer's
weights, the adapter merged by peft, float32) and saved with ``save_pretrained`` as a plain model folder, which
the engine runs as the specialist's own weights. A stamp (``scdviz-merged.json``) records the adapter's and the
producer's hashes, so a changed adapter is merged again and an unchanged one is not.

The tokenizer files written under transformers 5.2 are mis-read by the engine's transformers 5.19 (an
``<|endoftext|>`` between words): engines here get token ids, never text (``skip_tokenizer_init``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from scdviz import settings
from scdviz.models import builtin

STAMP = "scdviz-merged.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def engine_dir() -> Path:
    """Where merged specialist folders go: ``$SCDVIZ_CACHE/engine``."""
    return settings.cache_dir() / "engine"


def producer_folder() -> Path:
    """The built-in producer's safetensors folder (converted from its GGUF on first use)."""
    return builtin.producer_dir()


def specialist_folder(name: str) -> Path:
    """A built-in specialist (``builtin:NAME`` or ``NAME``) as a merged safetensors folder, made once."""
    name = name.removeprefix("builtin:")
    adapter = builtin.adapter_dir(name)  # ValueError for an unknown name
    producer = producer_folder()
    want = {"adapter": _sha256(adapter / "adapter_model.safetensors"),
            "adapter_config": _sha256(adapter / "adapter_config.json"),
            "producer": _sha256(next(producer.glob("*.safetensors")))}
    target = engine_dir() / name
    try:
        if json.loads((target / STAMP).read_text()) == want:
            return target
    except (OSError, ValueError):
        pass
    from scdviz.models.pair import load_model

    model, tokenizer = load_model(f"builtin:{name}", base=f"builtin:{builtin.PRODUCER_NAME}")
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / STAMP).write_text(json.dumps(want, indent=1))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target

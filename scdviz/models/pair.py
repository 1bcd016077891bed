"""Load a producer/consumer pair and check that they can share a KV cache.

Sources (strings):
  ``builtin:smollm2-135m``     the built-in producer (fetched and converted on first use)
  ``builtin:<specialist>``     the built-in producer + a LoRA adapter from assets/adapters/
  ``/path/to/folder``          a local HF model folder (config.json + weights)
  ``/path/to/adapter``         a local peft LoRA folder (adapter_config.json), applied to
                               the producer and merged
  ``org/name``                 a hub id (same from_pretrained path; needs network)

Models load with ``trust_remote_code=False``. What this module does not do: capture
tensors (scdviz.models.hf) or evaluate anything.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from scdviz import settings
from scdviz.models import builtin, family, hf


class PairError(ValueError):
    """A pair that cannot be loaded or cannot share a cache; the message says why."""


@dataclass
class ModelFacts:
    """Architecture facts of one model that decide whether caches are interchangeable."""

    architecture: str  # e.g. LlamaForCausalLM
    layers: int  # decoder layers
    hidden: int  # hidden size d
    heads: int  # query heads
    kv_heads: int  # key/value heads
    head_dim: int  # per-head dimension
    vocab: int  # vocabulary size of the embedding
    rope_theta: float | None  # RoPE base
    rope_scaling: str  # RoPE scaling config as text ("none" when absent)
    sliding_window: int | None  # sliding-window size, None for full attention
    layer_types: str  # per-layer attention types as text ("all full" when uniform)
    params: int  # parameter count
    tokenizer_hash: str  # hash of the tokenizer's vocabulary and special tokens

    @property
    def kv_bytes_per_token_fp16(self) -> int:
        """Bytes of an fp16 KV cache per token, all layers, keys and values."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


@dataclass
class Pair:
    """A producer and a consumer model sharing one tokenizer."""

    producer: torch.nn.Module
    consumer: torch.nn.Module
    tokenizer: object
    producer_source: str
    consumer_source: str
    producer_facts: ModelFacts
    consumer_facts: ModelFacts
    device: torch.device
    dtype: torch.dtype
    load_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def facts(self) -> ModelFacts:
        """The shared architecture facts (those of the producer)."""
        return self.producer_facts


def choose_device() -> tuple[torch.device, torch.dtype]:
    """CUDA with bf16 when present (or forced by SCDVIZ_DEVICE), else CPU with fp32."""
    want = settings.device_name()
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise PairError("SCDVIZ_DEVICE=cuda but no CUDA device is visible")
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def choose_threads(candidates: tuple[int, ...] | None = None) -> int:
    """Set torch's CPU thread count to the fastest of the candidates, measured now.

    On a shared 2-core machine two threads can be several times slower than one when
    another process is busy, so we time a layer-sized matmul rather than guess.
    SCDVIZ_THREADS fixes the number instead.
    """
    fixed = settings.threads()
    if fixed:
        torch.set_num_threads(fixed)
        return fixed
    import os

    cores = os.cpu_count() or 1
    candidates = candidates or tuple(sorted({1, max(1, cores // 2), cores}))
    a, b = torch.randn(256, 576), torch.randn(576, 1536)
    best, best_t = candidates[0], float("inf")
    for n in candidates:
        torch.set_num_threads(n)
        a @ b  # warm up
        t0 = time.perf_counter()
        for _ in range(20):
            a @ b
        elapsed = time.perf_counter() - t0
        if elapsed < best_t:
            best, best_t = n, elapsed
    torch.set_num_threads(best)
    return best


def facts_of(model, tokenizer) -> ModelFacts:
    """Read the compatibility-relevant facts from a loaded model and tokenizer."""
    cfg = model.config
    heads, kv_heads, head_dim = hf.attn_heads(model)
    types = getattr(cfg, "layer_types", None)
    rope_params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(rope_params.get("full_attention"), dict):  # one RoPE per layer type (Gemma-3): the full layers'
        theta = rope_params["full_attention"].get("rope_theta")  # base here, every type's under rope_scaling
    else:
        theta = rope_params.get("rope_theta", getattr(cfg, "rope_theta", None))
    scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    return ModelFacts(
        architecture=(cfg.architectures or [type(model).__name__])[0],
        layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=cfg.vocab_size,
        rope_theta=float(theta) if theta is not None else None,
        rope_scaling=str(scaling or getattr(cfg, "rope_scaling", None) or "none"),
        sliding_window=getattr(cfg, "sliding_window", None),
        layer_types="all full" if not types or set(types) == {"full_attention"} else ",".join(types),
        params=sum(p.numel() for p in model.parameters()),
        tokenizer_hash=tokenizer_hash(tokenizer),
    )


def tokenizer_hash(tokenizer) -> str:
    """A short hash of the vocabulary (token -> id) and the special tokens."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(map(str, tokenizer.all_special_tokens))
    return hashlib.sha256(repr((vocab, special)).encode()).hexdigest()[:12]


COMPARED = (
    ("architecture", "architecture class"),
    ("layers", "layers"),
    ("hidden", "hidden size"),
    ("heads", "attention heads"),
    ("kv_heads", "KV heads"),
    ("head_dim", "head_dim"),
    ("vocab", "vocabulary size"),
    ("tokenizer_hash", "tokenizer (vocabulary hash)"),
    ("rope_theta", "RoPE theta"),
    ("rope_scaling", "RoPE scaling"),
    ("sliding_window", "sliding window"),
    ("layer_types", "layer types"),
)


def mismatches(a: ModelFacts, b: ModelFacts) -> list[str]:
    """Every fact on which producer ``a`` and consumer ``b`` differ, with both values."""
    return [
        f"{label}: producer {getattr(a, key)!r} vs consumer {getattr(b, key)!r}"
        for key, label in COMPARED
        if getattr(a, key) != getattr(b, key)
    ]


def check_compatible(a: ModelFacts, b: ModelFacts) -> None:
    """Raise PairError listing every mismatch; return quietly for a compatible pair."""
    found = mismatches(a, b)
    if found:
        raise PairError("incompatible pair: the consumer cannot use the producer's KV cache:\n- " + "\n- ".join(found))


HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def looks_local(source: str) -> bool:
    """Whether a source string names a folder (a path) rather than a hub id ``org/name``."""
    return source.startswith(("/", ".", "~", "\\")) or "\\" in source or source.count("/") != 1


def source_kind(source) -> tuple[str, str]:
    """(kind, what) for a model source string: ('builtin', NAME), ('local', PATH) or ('hub', ID).

    ``builtin:NAME`` is only ever one of the shipped names (never joined to a path). PairError
    names what is accepted. Which sources a public demo may load is the app's rule, not this one.
    """
    if not isinstance(source, str) or not source.strip():
        raise PairError("empty model source; choose a built-in model, or type a model folder or hub id")
    source = source.strip()
    if source.startswith("builtin:"):
        name = source.split(":", 1)[1]
        if name not in builtin.BASES and name not in builtin.specialists():
            known = ", ".join(f"builtin:{n}"
                              for n in (builtin.PRODUCER_NAME, *builtin.specialists(), builtin.GEMMA_NAME))
            raise PairError(f"unknown built-in model {name[:60]!r}; built-in: {known}")
        return "builtin", name
    path = Path(source).expanduser()
    if looks_local(source) or path.exists():
        return "local", str(path)
    if not HUB_ID.fullmatch(source):
        raise PairError(f"{source[:80]!r} is neither a built-in name, an existing folder nor a hub id (org/name)")
    return "hub", source


def resolve_source(source: str) -> tuple[str, Path | str, Path | None]:
    """(kind, model location, adapter folder) for a source string (classified by ``source_kind``)."""
    kind, what = source_kind(source)
    if kind == "builtin":
        if what in builtin.BASES:
            return "builtin", what, None
        return "builtin", builtin.PRODUCER_NAME, builtin.adapter_dir(what)
    if kind == "hub":
        return "hub", what, None
    path = Path(what)
    if (path / "adapter_config.json").is_file():
        return "adapter", path, path
    if (path / "config.json").is_file():
        return "local", path, None
    raise PairError(f"{source.strip()}: not a model folder (no config.json) nor a LoRA folder (no adapter_config.json)")


def training_log(source: str) -> dict:
    """How a LoRA consumer was fine-tuned: ``finetune``'s train_log.json beside its adapter (its "config": corpus,
    task, targets, ...; "seconds", "loss", ...), {} for a full model or an adapter without that log."""
    try:
        adapter = resolve_source(source)[2]
        log = json.loads((Path(adapter) / "train_log.json").read_text()) if adapter else {}
    except (PairError, ValueError, OSError):
        return {}
    return log if isinstance(log, dict) else {}


def load_model(source: str, base: str | None = None, progress=None):
    """Load (model, tokenizer) from a source string; adapters go on ``base`` (default: built-in producer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per weight tensor floods logs; our own progress suffices
    kind, where, adapter = resolve_source(source)
    if kind == "builtin":
        where = builtin.base_dir(where, progress)
    elif kind == "adapter":
        base = base or f"builtin:{builtin.PRODUCER_NAME}"
        if resolve_source(base)[2] is not None:
            raise PairError("the base of a LoRA adapter must be a full model, not another adapter")
        model, tokenizer = load_model(base, progress=progress)
        return _merge_adapter(model, adapter), tokenizer
    _check_family(source, where)
    device, dtype = choose_device()
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, trust_remote_code=False,
                                                     use_safetensors=True)
        tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - any failure here is about the source the user named
        raise PairError(f"could not load {source.strip()!r} ({type(err).__name__}): {_first_line(err)}") from None
    if adapter is not None:
        model = _merge_adapter(model, adapter)
    model = model.to(device).eval()
    hf.exact_attention(model)  # e.g. Gemma-2's logit softcapping, which SDPA drops
    return model, tokenizer


def _check_family(source: str, where) -> None:
    """PairError before any weights load when the config's model family is not supported (``models.family``)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - an unreadable config is the user's input
        raise PairError(f"could not load {source.strip()!r} ({type(err).__name__}): {_first_line(err)}") from None
    why = family.unsupported(config)
    if why:
        raise PairError(f"{source.strip()}: {why}")


def _first_line(err: Exception, limit: int = 300) -> str:
    line = (str(err).strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _merge_adapter(model, adapter: Path):
    """Apply a peft LoRA adapter and merge it into the weights (plain model out)."""
    from peft import PeftModel

    try:
        merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    except Exception as err:  # noqa: BLE001 - a broken or foreign adapter is the user's input
        shape = "size mismatch" in str(err)
        raise PairError(
            f"the LoRA adapter in {adapter} does not fit its base model "
            + ("(its weight shapes belong to another model; pick the base it was trained on as producer)"
               if shape else f"({type(err).__name__}: {_first_line(err)})")) from None
    return merged.eval()


def load_pair(producer: str, consumer: str, progress=None) -> Pair:
    """Load both models, check compatibility (PairError listing every mismatch), return a Pair.

    A LoRA consumer is applied to the producer's weights when the producer is a full
    model. progress: optional callable(fraction, message).
    """
    t0 = time.perf_counter()
    if progress:
        progress(0.0, f"loading producer {producer}")
    prod, tok = load_model(producer, progress=progress)
    if progress:
        progress(0.5, f"loading consumer {consumer}")
    base = producer if resolve_source(producer)[2] is None else None
    cons, cons_tok = load_model(consumer, base=base, progress=progress)
    pf, cf = facts_of(prod, tok), facts_of(cons, cons_tok)
    check_compatible(pf, cf)
    device, dtype = choose_device()
    if device.type == "cpu":
        choose_threads()
    if progress:
        progress(1.0, "pair loaded")
    return Pair(
        producer=prod,
        consumer=cons,
        tokenizer=tok,
        producer_source=producer,
        consumer_source=consumer,
        producer_facts=pf,
        consumer_facts=cf,
        device=device,
        dtype=dtype,
        load_seconds=time.perf_counter() - t0,
    )

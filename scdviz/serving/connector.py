"""``ScdConnector``: a vLLM KV connector (``KVConnectorBase_V1``) that moves a prompt's KV between two engines as a
scdviz payload, through a shared folder (``scdviz.serving.kv.Store``).

Runs inside vLLM (the engine's venv); vLLM loads it by module path::

    KVTransferConfig(kv_connector="ScdConnector", kv_connector_module_path="scdviz.serving.connector",
                     kv_role="kv_producer" | "kv_consumer",
                     kv_connector_extra_config={"store": FOLDER, "channels": {NAME: CODEC, ...}, "stats": FILE})

A **channel** is one kind of payload, named by the caller (e.g. ``raw``, ``scd-<calibration tag>-reuse``) and
keyed into every store key; its CODEC is ``{"kind": "raw"}`` (the producer's K / V in fp16, token 0 recomputed
by the consumer: scdviz's raw reuse) or ``{"kind": "scd", "calibration": FOLDER, "patch_k": 0, "bits": B,
"budget": B/token}`` (SCD codes of that calibration). A producer encodes every prompt once per channel (one
prefill, a payload per target specialist: fan-out); a consumer request picks its channel with
``SamplingParams(extra_args={"scd_channel": NAME})`` (default: the first channel).

- **producer** (``kv_producer``, the producer's engine): when a new request's prompt is prefilled, the worker
  gathers the K / V of its whole blocks (``kv.matchable`` tokens: whole blocks, the last prompt token excluded)
  from every layer's paged cache as the layers run (``save_kv_layer``), and after the forward pass
  (``wait_for_save``) encodes them with scdviz's codec (``Codec.encode_kv``: ``codec`` ``{"kind": "raw"}`` for
  the producer's K / V in fp16, or ``{"kind": "scd", "calibration": FOLDER, "patch_k": 0, "bits": B,
  "budget": B/token}`` for SCD codes) and writes the payload under the key of (channel, token ids).
- **consumer** (``kv_consumer``, a specialist's engine, running the specialist's own merged weights): the
  scheduler matches the longest stored prefix (whole blocks, ``get_num_new_matched_tokens``); the worker reads
  the payload before the forward pass (``start_load_kv``), decodes it into the specialist's own K / V
  (``Codec.decode``: REUSE decoders, RoPE, token 0 recomputed by the specialist) and writes them into the
  request's paged blocks; vLLM then computes the rest of the prompt over them.

The scheduler-side and worker-side halves are two instances of this class in different processes: they share
only the metadata vLLM passes (``build_connector_meta`` -> ``bind_connector_metadata``) and the store's files.

The worker loads this engine's own weights a second time as a transformers model (the folder vLLM serves,
float32): the codec needs the producer's RoPE to recover pre-RoPE keys, and the consumer's weights to recompute
token 0 (and for PATCH layers, its projections). A plan with PATCH layers needs the producer's pre-attention
states, which the paged cache does not hold: this connector refuses such a plan (use ``patch_k: 0``).

Limits: a request's first ``matchable`` tokens must be prefilled in one engine step to be saved (the harness runs
with ``max_num_batched_tokens`` >= the prompt); a request resumed after preemption is not reloaded; one worker
(no tensor parallelism).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from scdviz.serving import kv

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)
LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class Transfer:
    """One request's prefix to save or load on one channel: its first ``len(token_ids)`` tokens, in ``block_ids``."""

    req_id: str
    channel: str
    token_ids: list[int]
    block_ids: list[int]
    key: str


@dataclass
class ScdMetadata(KVConnectorMetadata):
    """What the scheduler tells the worker for one engine step."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


CHECKED_ISA = ("vec",)  # the CPU attention kernels whose paged layout scdviz.serving.kv is checked against


def check_isa(layer) -> None:
    """Refuse a CPU attention kernel whose paged layout ``scdviz.serving.kv`` has not been checked against."""
    isa = getattr(layer, "isa", None)
    if isa is not None and isa not in CHECKED_ISA:
        raise RuntimeError(f"ScdConnector: the CPU attention kernel {isa!r} may lay out its paged KV otherwise than "
                           f"the checked {CHECKED_ISA} (scdviz.serving.kv); run the engine in float32")


def layer_index(layer_name: str) -> int:
    """The decoder layer of an attention layer's name (``model.layers.12.self_attn.attn`` -> 12)."""
    found = LAYER.search(layer_name)
    if not found:
        raise ValueError(f"cannot tell the decoder layer of {layer_name!r}")
    return int(found.group(1))


class ScdConnector(KVConnectorBase_V1):
    """Producer: encode a prefilled prompt's KV into a payload file; consumer: decode one into the paged blocks."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.store = kv.Store(cfg.get_from_extra_config("store", None) or _missing("store"))
        self.channels = {str(k): dict(v) for k, v in
                         (cfg.get_from_extra_config("channels", None) or {"raw": {"kind": "raw"}}).items()}
        self.stats_file = cfg.get_from_extra_config("stats", None)
        self.saves, self.loads = cfg.is_kv_producer, cfg.is_kv_consumer
        self.model_folder = vllm_config.model_config.model
        # scheduler side: requests whose prefix is to be loaded at their first step -> (channel, tokens to load)
        self._to_load: dict[str, tuple[str, int]] = {}
        # worker side, made on first use
        self._model = None
        self._codecs: dict[str, object] = {}
        self._gathered: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    # ------------------------------------------------------------------ scheduler side

    def channel_of(self, sampling_params) -> str:
        """The channel a request asks for (``extra_args["scd_channel"]``), else the first one."""
        extra = getattr(sampling_params, "extra_args", None) or {}
        channel = str(extra.get("scd_channel", next(iter(self.channels))))
        if channel not in self.channels:
            raise ValueError(f"ScdConnector: unknown channel {channel!r}; this engine has {sorted(self.channels)}")
        return channel

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.loads:
            return 0, False
        channel = self.channel_of(request.sampling_params)
        n = self.store.longest(channel, list(request.prompt_token_ids or []), self.block_size)
        return (n - num_computed_tokens, False) if n > num_computed_tokens else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        if num_external_tokens > 0:
            channel = self.channel_of(request.sampling_params)
            self._to_load[request.request_id] = (
                channel, self.store.longest(channel, list(request.prompt_token_ids or []), self.block_size))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ScdMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            ids = list(new.prompt_token_ids or [])
            blocks = list(new.block_ids[0])
            if new.req_id in self._to_load:
                channel, n = self._to_load.pop(new.req_id)
                meta.loads.append(Transfer(new.req_id, channel, ids[:n], blocks[: n // self.block_size],
                                           kv.prefix_key(channel, ids[:n])))
            elif self.saves:
                n = kv.matchable(len(ids), self.block_size)
                todo = [c for c in self.channels if n and not self.store.has(kv.prefix_key(c, ids[:n]))]
                if not todo:
                    continue
                scheduled = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
                if new.num_computed_tokens or scheduled < n:
                    logger.warning("ScdConnector: request %s prefills %d of %d tokens in this step; not saved",
                                   new.req_id, scheduled, n)
                    continue
                meta.saves += [Transfer(new.req_id, c, ids[:n], blocks[: n // self.block_size],
                                        kv.prefix_key(c, ids[:n])) for c in todo]
        self._to_load.clear()  # a request allocated but not scheduled this step is matched again next time
        return meta

    # ------------------------------------------------------------------ worker side

    def _own_model(self):
        """This engine's weights as a transformers model (float32, CPU): the codec's producer or consumer."""
        if self._model is None:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            self._model = AutoModelForCausalLM.from_pretrained(self.model_folder, dtype=torch.float32).eval()
        return self._model

    def codec(self, channel: str):
        """The scdviz Codec of a channel (made once per worker)."""
        if channel not in self._codecs:
            from scdviz.models import hf
            from scdviz.scd.calibration import Calibration
            from scdviz.scd.codec import Codec

            spec = self.channels[channel]
            if spec.get("kind", "raw") == "raw":
                codec = Codec.raw(hf.n_layers(self._own_model()), bits=int(spec.get("bits", 16)))
            elif spec["kind"] == "scd":
                calib = Calibration.load(spec["calibration"])
                codec = Codec.of(calib, patch_k=spec.get("patch_k", 0), bits=spec.get("bits"),
                                 budget=spec.get("budget"))
                if codec.plan.layers_in("patch"):
                    raise ValueError("ScdConnector: the paged cache holds no pre-attention states for PATCH "
                                     "layers; use a plan with patch_k 0")
            else:
                raise ValueError(f"ScdConnector: unknown codec kind {spec['kind']!r} (raw, scd)")
            self._codecs[channel] = codec
        return self._codecs[channel]

    def _stat(self, **row) -> None:
        if self.stats_file:
            with open(self.stats_file, "a") as f:
                f.write(json.dumps(row) + "\n")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ScdMetadata) or not meta.loads:
            return
        from scdviz.models import hf

        layers = {name: layer for name, layer in forward_context.no_compile_layers.items()
                  if getattr(layer, "kv_cache", None) is not None}
        for load in meta.loads:
            t0 = time.perf_counter()
            blob = self.store.get(load.key)
            t_read = time.perf_counter()
            with torch.inference_mode():
                cache = self.codec(load.channel).decode(self._own_model(), blob)
            keys, values = hf.cache_kv(cache)
            t_decode = time.perf_counter()
            if keys[0].shape[2] != len(load.token_ids):
                raise ValueError(f"payload {load.key} holds {keys[0].shape[2]} tokens, the match {len(load.token_ids)}")
            for name, layer in layers.items():
                check_isa(layer)
                i = layer_index(name)
                kv.scatter(layer.kv_cache, load.block_ids, keys[i][0], values[i][0])
            t_end = time.perf_counter()
            self._stat(event="load", req=load.req_id, channel=load.channel, tokens=len(load.token_ids), bytes=len(blob),
                       read_s=t_read - t0, decode_s=t_decode - t_read, write_s=t_end - t_decode, key=load.key)
            logger.info("ScdConnector: loaded %d tokens (%d bytes) for %s", len(load.token_ids), len(blob),
                        load.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ScdMetadata):
            return
        if meta.saves:
            from vllm.forward_context import get_forward_context

            check_isa(get_forward_context().no_compile_layers.get(layer_name))
        for save in meta.saves:
            if layer_index(layer_name) in self._gathered.get(save.req_id, {}):
                continue  # another channel of the same request: gathered once
            k, v = kv.gather(kv_layer, save.block_ids, len(save.token_ids))
            self._gathered.setdefault(save.req_id, {})[layer_index(layer_name)] = (k.clone(), v.clone())

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, ScdMetadata):
            return
        gathered, self._gathered = self._gathered, {}
        for save in meta.saves:
            got = gathered.get(save.req_id, {})
            t0 = time.perf_counter()
            n_layers = len(got)
            if sorted(got) != list(range(n_layers)) or n_layers == 0:
                logger.warning("ScdConnector: request %s has KV of layers %s only; not saved", save.req_id, sorted(got))
                continue
            keys = [got[i][0].unsqueeze(0) for i in range(n_layers)]
            values = [got[i][1].unsqueeze(0) for i in range(n_layers)]
            ids = torch.tensor([save.token_ids], dtype=torch.long)
            with torch.inference_mode():
                blob = self.codec(save.channel).encode_kv(self._own_model(), ids, keys, values)
            t_enc = time.perf_counter()
            self.store.put(save.key, blob)
            self._stat(event="save", req=save.req_id, channel=save.channel, tokens=len(save.token_ids), bytes=len(blob),
                       encode_s=t_enc - t0, write_s=time.perf_counter() - t_enc, key=save.key)


def _missing(name: str):
    raise ValueError(f"ScdConnector needs kv_connector_extra_config[{name!r}]")

"""SCD's wire API: one object that turns a producer's prefill into bytes and bytes into a consumer's cache.

A ``Codec`` is a plan (what each layer sends: raw K/V, REUSE codes, a PATCH code, or a
residual to recompute from; scdviz.scd.plan) and the calibration whose codes it uses
(scdviz.scd.calibration). ``encode`` runs on the producer's side, ``decode`` on the
consumer's; the bytes between them describe themselves (scdviz.scd.payload: the layer
modes, the token-0 rule and the calibration's tag travel in the header), so the receiver
needs only the calibration, never the plan. This is what an engine connector calls
(docs/serving.md). It evaluates nothing (scdviz.scd.bench does).

Shapes: ``ids`` (1, T) token ids of the prefix whose cache moves; the decoded cache holds T
positions per layer, (1, Hkv, T, D) keys and values on the consumer's device and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from scdviz.models import hf
from scdviz.scd import plan as plans
from scdviz.scd import transfer
from scdviz.scd.calibration import Calibration, shipped_folder
from scdviz.scd.plan import Plan
from scdviz.scd.transfer import ProducerState


@dataclass(frozen=True)
class Codec:
    """A plan and its calibration: ``encode(producer, ids) -> bytes``, ``decode(consumer, bytes) -> cache``."""

    plan: Plan  # per-layer decisions (scdviz.scd.plan)
    # the codes' calibration; None for plans without codes (raw, 4-bit, recompute)
    calibration: Calibration | None = None

    def __post_init__(self) -> None:
        coded = [m for m in self.plan.modes if m in ("code", "patch")]
        if coded and self.calibration is None:
            raise ValueError(f"the plan {self.plan.name!r} sends REUSE / PATCH codes: give its calibration")
        if self.calibration is not None and len(self.plan.modes) != self.calibration.n_layers:
            raise ValueError(f"the plan has {len(self.plan.modes)} layers, the calibration {self.calibration.n_layers}")

    @classmethod
    def shipped(cls, pair, patch_k: int | None = None, bits: int | None = None, placement: str = "selected",
                budget: float | None = None, tail: int = 0) -> Codec:
        """The shipped calibration of ``pair``'s consumer (identity-checked) with SCD full's plan:
        ``patch_k`` PATCH layers in ``placement`` order ("selected" or "drift") and codes at ``bits``
        (default: the calibration's operating point); or, with ``budget`` (payload bytes/token),
        transform-coded REUSE codes held to that budget. ``tail`` > 0: the consumer recomputes the last
        ``tail`` prefix tokens itself (``Plan.tail``; their ids travel in the payload)."""
        calib = Calibration.load(shipped_folder(pair.consumer_source), pair)
        return cls.of(calib, patch_k=patch_k, bits=bits, placement=placement, budget=budget, tail=tail)

    @classmethod
    def of(cls, calib: Calibration, patch_k: int | None = None, bits: int | None = None, placement: str = "selected",
           budget: float | None = None, tail: int = 0) -> Codec:
        """SCD full's plan on ``calib`` (see ``shipped``)."""
        if budget is not None:
            plan = plans.tc_plan(calib, budget)
        else:
            plan = plans.user_plan(calib, patch_k=patch_k, placement=placement, bits=bits)
        return cls(plans.with_tail(plan, tail) if tail else plan, calib)

    @classmethod
    def raw(cls, n_layers: int, bits: int = 16) -> Codec:
        """The baseline that sends the producer's own K, V (fp16, or KIVI-style ``bits`` 4 / 8)."""
        return cls(plans.raw_plan(n_layers, bits=bits))

    def encode(self, producer, ids: Tensor | None = None) -> bytes:
        """The payload for the prefix ``ids`` (1, T): prefills ``producer`` on it, or takes an
        already captured ``transfer.ProducerState`` as ``producer`` (then no ``ids``)."""
        if isinstance(producer, ProducerState):
            state = producer
        else:
            if ids is None or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
                raise ValueError("encode needs ids of shape (1, T) with T >= 2 (one prompt prefix)")
            state = transfer.producer_state(producer, ids.to(hf.device_of(producer)))
        return transfer.build_payload(state, self.plan, self.calibration)

    def encode_kv(self, producer, ids: Tensor, keys: list[Tensor], values: list[Tensor],
                  h_in: dict[int, Tensor] | None = None) -> bytes:
        """The payload from a prefill that already ran, as an engine connector has it: per layer the
        producer's post-RoPE ``keys`` and ``values`` (1, Hkv, T, D) of the prefix ``ids`` (1, T), and
        for each PATCH layer of the plan its normalised pre-attention state ``h_in[layer]`` (T, d).
        ``producer`` gives only its RoPE (to recover the pre-RoPE keys the codes are fitted on); a plan
        with recomputed layers needs the residual stream, which a KV cache does not hold: use ``encode``."""
        if "recompute" in self.plan.modes:
            raise ValueError(f"the plan {self.plan.name!r} recomputes layers from the producer's residual stream; "
                             "a KV cache does not hold it: use encode(producer, ids)")
        missing = sorted(set(self.plan.layers_in("patch")) - set(h_in or {}))
        if missing:
            raise ValueError(f"the plan patches layers {missing}: give their h_in (T, d), captured at input_layernorm")
        if len(keys) != len(self.plan.modes) or len(values) != len(self.plan.modes):
            raise ValueError(f"give keys and values of all {len(self.plan.modes)} layers, got {len(keys)} and "
                             f"{len(values)}")
        positions = torch.arange(ids.shape[1], device=keys[0].device).unsqueeze(0)
        cos, sin = hf.rope(producer, positions)
        keys_pre = [hf.unrotate(k, cos.to(k.dtype), sin.to(k.dtype)) for k in keys]
        state = transfer.host_state(ids, keys_pre, keys, values, [(h_in or {}).get(i) for i in range(len(keys))], [])
        return transfer.build_payload(state, self.plan, self.calibration)

    def decode(self, consumer, blob: bytes):
        """The consumer's DynamicCache over the payload's T tokens (its device and dtype); feed the
        next token at position T. ValueError for a foreign, damaged or other-calibration payload."""
        return transfer.receive(consumer, blob, self.calibration).cache

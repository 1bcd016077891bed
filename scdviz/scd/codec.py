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
        already captured ``transfer.ProducerState`` as ``producer`` (then no ``ids``).

        The prefill captures only what the plan reads (pre-RoPE keys with REUSE layers, H_in with
        PATCH layers, the residual stream with recomputed ones; logits at the last position alone),
        and only what the plan sends leaves the producer's device, one layer at a time
        (``sent_state``): host memory is the payload's, not every capture of every layer."""
        if isinstance(producer, ProducerState):
            state = producer
        else:
            if ids is None or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
                raise ValueError("encode needs ids of shape (1, T) with T >= 2 (one prompt prefix)")
            modes = set(self.plan.modes)
            capture = {name for name, mode in (("keys_pre", "code"), ("h_in", "patch"), ("resid", "recompute"))
                       if mode in modes}
            trace = hf.forward(producer, ids.to(hf.device_of(producer)), capture=capture, last_logits=True)
            state = sent_state(self.plan, ids, trace.keys_pre, trace.keys, trace.values,
                               [h[0] for h in trace.h_in], [r[0] for r in trace.resid])
            del trace  # the captures the plan does not read go now
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
        rope = hf.Rope(producer, positions)
        keys_pre = [rope.unrotate(layer, k) for layer, k in enumerate(keys)]
        state = sent_state(self.plan, ids, keys_pre, keys, values, [(h_in or {}).get(i) for i in range(len(keys))],
                           [])
        return transfer.build_payload(state, self.plan, self.calibration)

    def decode(self, consumer, blob: bytes):
        """The consumer's DynamicCache over the payload's T tokens (its device and dtype); feed the
        next token at position T. ValueError for a foreign, damaged or other-calibration payload."""
        return transfer.receive(consumer, blob, self.calibration).cache


class _PerLayer:
    """One per-layer field of a ``ProducerState`` as ``build_payload`` reads it: ``made(layer, tensor)`` when it
    reads a layer, for the layers in ``tensors`` alone; the reference is dropped once read, so what the plan sent
    from a layer can be freed while the next is made. Any other read is a LookupError (nothing else moves)."""

    def __init__(self, tensors: dict[int, Tensor], n_layers: int, made):
        self._tensors, self._n, self._made = tensors, n_layers, made

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, layer: int) -> Tensor:
        if layer not in self._tensors:
            raise LookupError(f"layer {layer}: read twice, or not sent by the plan (the codec kept only what it sends)")
        return self._made(layer, self._tensors.pop(layer))


def sent_state(plan: Plan, ids: Tensor, keys_pre: list[Tensor], keys: list[Tensor], values: list[Tensor],
               h_in: list[Tensor | None], resid: list[Tensor]) -> ProducerState:
    """A ``ProducerState`` for ``transfer.build_payload(state, plan)`` holding only what ``plan`` sends, from
    per-layer keys_pre / keys / values (1, Hkv, T, D), h_in (T, d) or None and resid (T, d) (may be empty when
    the plan reads none) on any device and dtype. ``transfer.host_state`` moves every layer of every field to the
    host in float32; here each layer is moved or converted when ``build_payload`` reads it, and only:

    - raw layers' K / V stay on their device, as the sections the payload holds: fp16 when the plan sends them at
      16 bits (payload.encode rounds them to fp16 itself: the same bytes), else in their own dtype (quantisation
      reads them in float32);
    - REUSE layers' pre-RoPE keys and values, and PATCH layers' H_in, go to the host in their own dtype, one layer
      at a time, for the calibration's codes (which read them in float32; only the codes stay);
    - the residual stream entering each recomputed run, as a 16-bit section like a raw one.

    The bytes are those of ``build_payload(transfer.host_state(...), plan)``."""
    n = len(plan.modes)
    raw, coded, patched = (set(plan.layers_in(mode)) for mode in ("raw", "code", "patch"))

    def kv(layer: int, x: Tensor) -> Tensor:  # a raw or REUSE layer's K or V (1, Hkv, T, D) -> (T, Hkv*D)
        rows = transfer.flat(x.detach())
        if layer in raw:
            return rows.to(torch.float16) if plan.raw_bits == 16 else rows
        return rows.cpu()

    def only(tensors: list, layers: set[int]) -> dict[int, Tensor]:
        return {i: tensors[i] for i in layers}

    return ProducerState(
        ids=ids.cpu(), keys_pre=_PerLayer(only(keys_pre, coded), n, kv), keys=_PerLayer(only(keys, raw), n, kv),
        values=_PerLayer(only(values, raw | coded), n, kv),
        h_in=_PerLayer(only(h_in, patched), n, lambda _, h: h.detach().cpu()),
        resid=_PerLayer(only(resid, {start for start, _ in plan.runs()}), n + 1,
                        lambda _, r: r.detach().to(torch.float16)), seconds=0.0)

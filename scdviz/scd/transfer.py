"""The one transfer machinery: producer prefill -> payload bytes -> consumer cache -> scoring.

Every method is a Plan (scdviz.scd.plan) run by ``build_payload`` (producer side) and
``receive`` (consumer side); nothing here is specific to one method. Conventions
(scdviz.data.split_prompt): a transferred cache covers prompt[:-1] (T tokens); the consumer feeds the
last prompt token, then the continuation. Timings are wall-clock seconds on this
machine. Does not fit codes (scdviz.scd.calibrate) nor aggregate results
(scdviz.scd.measure).

Shapes: rows of a layer are tokens, columns are heads flattened: keys / values (T, Hkv*D),
h_in / resid (T, d).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from scdviz import data, timing
from scdviz.models import hf
from scdviz.scd import entropy, payload
from scdviz.scd.payload import Layout, Section
from scdviz.scd.plan import Plan


@dataclass
class ProducerState:
    """The producer's prefill of one prompt prefix, per layer (batch dim dropped)."""

    ids: Tensor  # (1, T) prefix token ids
    keys_pre: list[Tensor]  # (T, Hkv*D) pre-RoPE keys
    keys: list[Tensor]  # (T, Hkv*D) post-RoPE keys
    values: list[Tensor]  # (T, Hkv*D)
    h_in: list[Tensor]  # (T, d) input_layernorm outputs
    resid: list[Tensor]  # (T, d) residual entering layer l (L + 1 entries)
    seconds: float  # the producer's prefill time


@dataclass
class Received:
    """What the consumer built from a payload."""

    cache: object  # DynamicCache over the T prefix tokens
    seconds: float  # consumer compute: parse, decode codes, align, regenerate, recompute


@dataclass
class Case:
    """One evaluation prompt, prepared once and shared by every method."""

    state: ProducerState  # producer prefill of the prefix
    fed: Tensor  # (1, n) last prompt token + continuation[:-1]
    targets: Tensor  # (1, n) continuation
    oracle_logits: Tensor  # (n, V) the consumer's own teacher-forced logits
    oracle_resid: list[Tensor]  # (n, d) the oracle's continuation residual stream per layer (L + 1)
    oracle_cache: object  # the consumer's own DynamicCache of the prefix (ideal patches, drift)
    prefill_seconds: float  # the consumer's measured prefill of the prefix (decoder only, no LM head)
    step_seconds: float  # the consumer's measured first decode step (feeding the last prompt token)
    qa_item: object = None  # optional scdviz.qa.QAItem about the prompt, answered from every method's cache

    @property
    def oracle_seconds(self) -> float:
        """The oracle's TTFT: its own prefill plus the first decode step."""
        return self.prefill_seconds + self.step_seconds


@dataclass
class PlanRun:
    """One plan executed on one Case."""

    payload_bytes: int  # length of the real payload
    encode_seconds: float  # producer-side work beyond its prefill (encoding)
    consumer_seconds: float  # receive + first decode step
    cache: object  # the consumer's DynamicCache over the prefix
    logits: Tensor  # (n, V) teacher-forced continuation logits
    resid: list[Tensor]  # (n, d) continuation residual stream per layer (L + 1)
    spans: list = field(default_factory=list)  # scdviz.scd.payload.Span of every section of the payload


def flat(x: Tensor) -> Tensor:
    """(1, Hkv, T, D) -> (T, Hkv*D)."""
    return x[0].transpose(0, 1).reshape(x.shape[2], -1)


def heads(x: Tensor, n_kv: int) -> Tensor:
    """(T, Hkv*D) -> (1, Hkv, T, D)."""
    return x.reshape(x.shape[0], n_kv, x.shape[1] // n_kv).transpose(0, 1).unsqueeze(0)


def producer_state(model, prefix: Tensor) -> ProducerState:
    """Prefill the producer on ``prefix`` (1, T), keeping what any plan may send."""
    device = hf.device_of(model)
    t0 = timing.clock(device)
    tr = hf.forward(model, prefix, capture=hf.CAPTURE_ALL)
    seconds = timing.clock(device) - t0
    return host_state(prefix, tr.keys_pre, tr.keys, tr.values, [h[0] for h in tr.h_in], [r[0] for r in tr.resid],
                      seconds)


def host_state(ids: Tensor, keys_pre: list[Tensor], keys: list[Tensor], values: list[Tensor],
               h_in: list[Tensor | None], resid: list[Tensor], seconds: float = 0.0) -> ProducerState:
    """A ``ProducerState`` on the host in float32 (codes and aligners live on the CPU) from per-layer
    keys / values (1, Hkv, T, D), h_in (T, d) or None and resid (T, d), on any device and dtype."""
    cpu = lambda t: None if t is None else t.detach().float().cpu()  # noqa: E731
    return ProducerState(ids=ids.cpu(), keys_pre=[cpu(flat(k)) for k in keys_pre], keys=[cpu(flat(k)) for k in keys],
                         values=[cpu(flat(v)) for v in values], h_in=[cpu(h) for h in h_in],
                         resid=[cpu(r) for r in resid], seconds=seconds)


def build_payload(state: ProducerState, plan: Plan, calib=None) -> bytes:
    """The producer's message for ``plan`` (calib: a Calibration for code/patch layers). With a recomputed tail
    (``plan.tail``) the sections cover the prefix without its last ``tail`` tokens, whose ids the header carries."""
    n_tokens = state.ids.shape[1]
    cut = n_tokens - plan.tail
    if plan.tail and cut < 1:
        raise ValueError(f"a recomputed tail of {plan.tail} tokens leaves {cut} of this {n_tokens}-token prefix; "
                         "a tail must leave token 0 (the consumer builds its cache on it)")
    rows = slice(1 if plan.sink == "recompute" else 0, cut)
    sections: list[Section] = []
    for layer, mode in enumerate(plan.modes):
        if mode == "raw":
            k, v = state.keys[layer][rows], state.values[layer][rows]
            w = min(plan.raw_window, k.shape[0] - 1) if plan.raw_bits < 16 else 0
            sections.append(Section(layer, "k", k[: k.shape[0] - w], plan.raw_bits, plan.raw_group, "channel",
                                    plan.entropy))
            sections.append(Section(layer, "v", v[: v.shape[0] - w], plan.raw_bits, plan.raw_group, "token",
                                    plan.entropy))
            if w:
                sections += [Section(layer, "k_recent", k[-w:]), Section(layer, "v_recent", v[-w:])]
        elif mode == "code":
            zk = calib.key_codes[layer].encode(state.keys_pre[layer][rows], plan.rank_k[layer])
            zv = calib.value_codes[layer].encode(state.values[layer][rows], plan.rank_v[layer])
            for kind, z, steps in (("k", zk, plan.steps_k), ("v", zv, plan.steps_v)):
                bits = plan.bits_of(layer, kind)
                sections.append(Section(layer, f"{kind}_code", z, bits, plan.code_group, "channel", plan.entropy,
                                        step=steps[layer] if bits == 0 else 0.0))
        elif mode == "patch":
            z = calib.patch_for(layer).encode(state.h_in[layer][rows])
            sections.append(Section(layer, "h_code", z, plan.bits_of(layer, "h"), plan.code_group, "channel",
                                    plan.entropy))
    for start, _ in plan.runs():
        sections.append(Section(start, "resid", state.resid[start][: cut]))
    uses_codes = any(m in ("code", "patch") for m in plan.modes)
    head = Layout(cut, int(state.ids[0, 0]), list(plan.modes), plan.sink, calib.tag if uses_codes else 0,
                  state.ids[0, cut:].tolist())
    if plan.rate_target:  # bytes per prefix token: the recomputed tail's tokens count, as every token does
        return _rate_controlled(head, sections, int(plan.rate_target * n_tokens))
    return payload.encode(head, sections)


def _rate_controlled(head: Layout, sections: list[Section], allowed: int) -> bytes:
    """The payload with every transform-coded section's relative step scaled by one factor whose
    real length is at most ``allowed`` bytes: the finest scale the coder's estimate puts 0.4–0.6%
    under it (``entropy.fit_scale``), then coarser by 1% steps until the real message fits."""
    coded = [s for s in sections if s.bits == 0]
    n_tokens = head.n_tokens
    fixed = payload.payload_len([s for s in sections if s.bits != 0], len(head.modes))
    rel = [s.step for s in coded]
    least = fixed + len(coded) * (payload.SECTION.size + entropy.EMPTY_LEN)  # every coded section all zero
    if least > allowed:
        raise ValueError(f"a budget of {allowed / n_tokens:g} B/token is below the smallest transform-coded payload "
                         f"for {n_tokens} tokens ({least / n_tokens:.1f} B/token)")
    # the estimate codes a sample of rows: aim a little low, rarely re-encode
    target = max(int(allowed * 0.996), least) - fixed
    scale = entropy.fit_scale([s.data for s in coded], rel, target, payload.SECTION.size)
    while True:
        for s, r in zip(coded, rel):
            s.step = scale * r
        blob = payload.encode(head, sections)
        if len(blob) <= allowed:
            return blob
        scale *= 1.01


def receive(model, blob: bytes, calib=None, corrections: dict | None = None) -> Received:
    """Build the consumer's cache from a payload, timing the consumer's compute.

    The payload's header says what to do at each layer, with token 0 and with the prefix tokens it left
    out (a recomputed tail: the consumer runs them over the cache it built, so the cache covers the whole
    prefix); ``calib`` (the
    calibration the header names) decodes its REUSE and PATCH codes, and applies its trained
    corrections (``Calibration.correct``) or ``corrections`` instead (training them: the cache then
    carries their autograd graph). ValueError for a message with codes and no calibration, or codes
    of another calibration.
    """
    t0 = timing.clock(hf.device_of(model))
    msg = payload.decode(blob)
    head = msg.layout
    if head.calibration and calib is None:
        raise ValueError("this payload holds SCD codes: decode it with the calibration that made them")
    if head.calibration and head.calibration != calib.tag:
        raise ValueError(f"this payload was coded with calibration {head.calibration:016x}, not with the given "
                         f"{calib.tag:016x} ({calib.identity.get('consumer_source')!r}): use the sender's calibration")
    modes = head.modes
    n_kv = hf.attn_heads(model)[1]
    param = next(model.parameters())
    by, noise_of = sections_of(msg)

    def dev(t: Tensor) -> Tensor:
        return t.to(device=param.device, dtype=param.dtype)

    skip = 1 if head.sink == "recompute" else 0
    positions = torch.arange(skip, msg.n_tokens, device=hf.device_of(model)).unsqueeze(0)
    rope = hf.Rope(model, positions)
    keys: list[Tensor | None] = [None] * len(modes)
    values: list[Tensor | None] = [None] * len(modes)
    for layer, mode in enumerate(modes):
        if mode == "raw":
            k, v = by[layer, "k"], by[layer, "v"]
            if (layer, "k_recent") in by:
                k, v = torch.cat([k, by[layer, "k_recent"]]), torch.cat([v, by[layer, "v_recent"]])
            keys[layer], values[layer] = heads(dev(k), n_kv), heads(dev(v), n_kv)
        elif mode == "code":
            if corrections is None:  # the calibration's own: one folded map, on the consumer's device
                k_pre, v = calib.decoded(layer, by[layer, "k_code"], by[layer, "v_code"],
                                         code_noise(layer, by, noise_of), param.device)
            else:  # corrections in training: step by step, their autograd graph kept
                k_pre, v = reuse_rows(calib, layer, by, noise_of)
                k_pre, v = calib.correct(layer, dev(k_pre), dev(v), corrections)
            keys[layer] = rope.rotate(layer, heads(dev(k_pre), n_kv))
            values[layer] = heads(dev(v), n_kv)
        elif mode == "patch":
            h = dev(calib.patch_for(layer).decode(by[layer, "h_code"]))
            keys[layer], values[layer] = hf.kv_from_hin(model, layer, h.unsqueeze(0), positions)
    all_positions = torch.arange(msg.n_tokens, device=hf.device_of(model)).unsqueeze(0)
    for start, stop in payload.recompute_runs(modes):
        _, ks, vs = hf.run_layers(model, dev(by[start, "resid"]).unsqueeze(0), all_positions, start, stop)
        keys[start:stop], values[start:stop] = ks, vs
    if head.sink == "recompute":
        _put_own_sink(model, msg.token0, msg.n_tokens, keys, values)
    cache = hf.make_cache(model, keys, values)
    if head.tail:  # the consumer runs the tail itself over what it received: the cache grows to the whole prefix
        tail = torch.arange(msg.n_tokens, msg.n_tokens + len(head.tail), device=hf.device_of(model)).unsqueeze(0)
        trained = torch.is_grad_enabled() and any(t.requires_grad for t in (*keys, *values))  # training through it
        hf.forward(model, hf.ids_tensor(head.tail, hf.device_of(model)), cache=cache, positions=tail, grad=trained)
    return Received(cache, timing.clock(hf.device_of(model)) - t0)


def sections_of(msg) -> tuple[dict, dict]:
    """A decoded payload's sections by (layer, kind): their data (float32, CPU) and their quantisation
    error variance per column (None where not quantised)."""
    return ({(s.layer, s.kind): s.data for s in msg.sections}, {(s.layer, s.kind): s.noise for s in msg.sections})


def code_rows(calib, blob: bytes):
    """(layer, rows) for each code layer of a payload, its decoded, refined [K_pre, V] (N, 2 d_kv) as ``receive``
    gives them to a trained correction (``reuse_rows``)."""
    msg = payload.decode(blob)
    by, noise_of = sections_of(msg)
    for layer, mode in enumerate(msg.layout.modes):
        if mode == "code":
            yield layer, torch.cat(reuse_rows(calib, layer, by, noise_of), 1)


def reuse_rows(calib, layer: int, by: dict, noise_of: dict) -> tuple[Tensor, Tensor]:
    """A code layer's decoded, refined (K_pre, V) rows (N, d_kv) each, before any trained correction, from a
    payload's sections ``by`` and their quantisation noise ``noise_of`` ((layer, kind) -> tensor)."""
    return calib.refined(layer, by[layer, "k_code"], by[layer, "v_code"], code_noise(layer, by, noise_of))


def code_noise(layer: int, by: dict, noise_of: dict) -> tuple[Tensor, Tensor]:
    """A code layer's quantisation error variance per sent key and value code channel (zeros where not quantised)."""
    return tuple(torch.zeros(by[layer, kind].shape[1], device=hf.HOST) if noise_of[layer, kind] is None
                 else noise_of[layer, kind] for kind in ("k_code", "v_code"))


def transferred(model, state: ProducerState, plan: Plan, calib=None):
    """The consumer's cache after ``state`` went through ``plan``'s payload (no timing kept)."""
    return receive(model, build_payload(state, plan, calib), calib).cache


def _put_own_sink(model, token0: int, n_tokens: int, keys: list[Tensor], values: list[Tensor]) -> None:
    """Give every layer the consumer's own K, V of token 0: prepended to T-1 rows, or replacing row 0 of T."""
    own = hf.decoder_cache(model, hf.ids_tensor([token0], hf.device_of(model)))
    for layer, (own_k, own_v) in enumerate(zip(*hf.cache_kv(own))):
        for store, mine in ((keys, own_k), (values, own_v)):
            rest = store[layer]
            rest = rest[:, :, 1:] if rest.shape[2] == n_tokens else rest
            store[layer] = torch.cat([mine.to(rest.dtype), rest], dim=2)


def continuation(model, cache, case_fed: Tensor, start: int) -> tuple[Tensor, list[Tensor]]:
    """Teacher-forced logits (n, V) and residual stream per layer [(n, d)] on a copy of ``cache``."""
    positions = torch.arange(start, start + case_fed.shape[1], device=hf.device_of(model)).unsqueeze(0)
    tr = hf.forward(model, case_fed, cache=hf.clone_cache(model, cache), positions=positions, capture={"resid"})
    return tr.logits[0], [r[0] for r in tr.resid]


def prepare_case(producer, consumer, window: list[int], cont_len: int) -> Case:
    """Producer prefill, the oracle's timed prefill and its teacher-forced continuation."""
    prefix, fed, targets = data.split_prompt(window, cont_len)
    state = producer_state(producer, prefix)
    prefill, cache = timing.timed(hf.decoder_cache, consumer, prefix, device=hf.device_of(consumer))
    step = first_step_seconds(consumer, cache, fed, prefix.shape[1])
    logits, resid = continuation(consumer, cache, fed, prefix.shape[1])
    return Case(state, fed, targets, logits, resid, cache, prefill, step)


def first_step_seconds(model, cache, fed: Tensor, start: int) -> float:
    """Time of one decode step (the last prompt token) on a copy of the cache."""
    copy, device = hf.clone_cache(model, cache), hf.device_of(model)
    t0 = timing.clock(device)
    hf.forward(model, fed[:, :1], cache=copy, positions=torch.tensor([[start]], device=device))
    return timing.clock(device) - t0


def run_plan(consumer, case: Case, plan: Plan, calib=None) -> PlanRun:
    """Payload, consumer cache and teacher-forced continuation for one plan on one case."""
    encode, blob = timing.timed(build_payload, case.state, plan, calib, device=hf.device_of(consumer))
    got = receive(consumer, blob, calib)
    start = case.state.ids.shape[1]
    logits, resid = continuation(consumer, got.cache, case.fed, start)
    return PlanRun(len(blob), encode, got.seconds + case.step_seconds, got.cache, logits, resid, payload.spans(blob)[1])

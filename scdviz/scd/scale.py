"""SCD's consumer-side work timed at real model shapes (random weights), against the oracle's prefill.

A timing does not depend on weight values, so a model with the layer shapes of Mistral-7B or of
a 32B-class model and random weights, ``n_timed`` decoder layers deep, is timed and scaled to
the real depth. Per prompt length: the oracle's prefill (decoder only) and SCD's consumer-side
steps: token 0 recomputed (a 1-token forward), every layer's key and value codes decoded
(z @ D + μ) and the keys rotated (RoPE), ``patches`` layers regenerated from an aligned H_in
(identity + linear aligner, then the model's own k/v projections and RoPE), and this
implementation's payload parsing (on the CPU: unpack and dequantise one layer's code sections,
times the depth). Link time at 1, 10 and 100 Gbit/s for a payload of ``fraction`` of the fp16
KV bytes. Medians of ``reps`` interleaved rounds after ``warmup`` (``scdviz.timing``, the harness
every cost goes through; CUDA synchronised). The GPU check
(python -m research.gpu_check --timing) runs this; on CPU it only checks the code path.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from scdviz import link as links
from scdviz import timing
from scdviz.models import hf
from scdviz.scd import payload

SHAPES = {  # hidden, layers, heads, kv heads, head_dim, ffn, vocab
    "Mistral-7B": (4096, 32, 32, 8, 128, 14336, 32000),
    "Qwen-32B": (5120, 64, 40, 8, 128, 27648, 152064),
    "tiny": (64, 4, 4, 2, 16, 128, 128),
}


@dataclass
class Timing:
    """One timing run at a named shape (SHAPES); ``rows()`` gives one row per prompt length."""

    shape: str  # a key of SHAPES
    tokens: tuple[int, ...] = (1024, 4096)  # prompt lengths
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    n_timed: int = 2  # decoder layers built and timed (scaled to the shape's depth)
    reps: int = 5  # timings per step (median)
    warmup: int = 2  # untimed runs before them
    rank_k: float = 0.5  # key code rank, a fraction of d_kv
    rank_v: float = 0.75  # value code rank, a fraction of d_kv
    bits: int = 3  # code bits
    patches: int = 2  # PATCH layers regenerated
    fraction: float = 1 / 6  # payload size, a fraction of the fp16 KV bytes

    def rows(self) -> list[dict]:
        """One row per prompt length; see the module docstring."""
        hidden, _, heads, kv_heads, head_dim, ffn, vocab = SHAPES[self.shape]
        model = hf.random_llama(hidden, self.n_timed, heads, kv_heads, head_dim, ffn, vocab, self.device, self.dtype)
        d_kv = kv_heads * head_dim
        rk, rv = max(1, int(self.rank_k * d_kv)), max(1, int(self.rank_v * d_kv))
        g = torch.Generator(device="cpu").manual_seed(0)
        dec_k = torch.randn(rk, d_kv, generator=g).to(self.device, self.dtype)
        dec_v = torch.randn(rv, d_kv, generator=g).to(self.device, self.dtype)
        aligner = (torch.randn(hidden, hidden, generator=g) / hidden**0.5).to(self.device, self.dtype)
        return [self._one_length(model, t, g, dec_k, dec_v, aligner) for t in self.tokens]

    def _one_length(self, model, t: int, g, dec_k: Tensor, dec_v: Tensor, aligner: Tensor) -> dict:
        """The row of one prompt length: dec_k / dec_v (r, d_kv) code decoders, aligner (d, d)."""
        device, dtype, reps, warmup, bits, fraction = (self.device, self.dtype, self.reps, self.warmup, self.bits,
                                                       self.fraction)
        hidden, layers, _, kv_heads, head_dim, _, vocab = SHAPES[self.shape]
        rk, rv, patches, n_timed = dec_k.shape[0], dec_v.shape[0], self.patches, self.n_timed
        d_kv = kv_heads * head_dim
        mu = torch.zeros(d_kv, device=device, dtype=dtype)
        scale = layers / n_timed
        ids = torch.randint(0, vocab, (1, t), generator=g).to(device)
        positions = torch.arange(1, t, device=device).unsqueeze(0)
        cos, sin = hf.rope(model, positions)
        zk = torch.randn(t - 1, rk, generator=g).to(device, dtype)
        zv = torch.randn(t - 1, rv, generator=g).to(device, dtype)
        h = torch.randn(1, t - 1, hidden, generator=g).to(device, dtype)

        def codes():
            k = (zk @ dec_k + mu).view(1, t - 1, kv_heads, head_dim).transpose(1, 2)
            hf.rotate(k, cos, sin)
            (zv @ dec_v + mu).view(1, t - 1, kv_heads, head_dim)

        def patch():
            hf.kv_from_hin(model, 0, h + h @ aligner, positions)

        sections = [payload.Section(0, "k_code", torch.randn(t - 1, rk, generator=g), bits, 64),
                    payload.Section(0, "v_code", torch.randn(t - 1, rv, generator=g), bits, 64)]
        blob = payload.encode(payload.Layout(t, 0), sections)
        steps = {"oracle": lambda: hf.decoder_cache(model, ids), "token0": lambda: hf.decoder_cache(model, ids[:, :1]),
                 "codes": codes, "patch": patch, "parse": lambda: payload.decode(blob)}  # parse: on the CPU

        def trial(name: str) -> dict[str, float]:
            return {"seconds": timing.timed(steps[name], device="cpu" if name == "parse" else device)[0]}

        with torch.no_grad():
            samples = timing.interleaved(trial, list(steps), reps, warmup, random.Random(0))
        med = {name: q[1] for (name, _), q in timing.summary(samples).items()}
        oracle, token0 = med["oracle"] * scale, med["token0"] * scale
        code, regen, parse = med["codes"] * layers, med["patch"] * patches, med["parse"] * layers
        fp16 = 2 * layers * d_kv * 2
        row = {"model": self.shape, "tokens": t, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
               "layers_timed": n_timed, "oracle_prefill_ms": 1000 * oracle, "token0_ms": 1000 * token0,
               "codes_ms": 1000 * code, "patches_ms": 1000 * regen, "parse_cpu_ms": 1000 * parse,
               "payload_mb": fraction * fp16 * t / 1e6}
        consumer = token0 + code + regen + parse
        row["scd_consumer_ms"] = 1000 * consumer
        for gbps in (1, 10, 100):
            wire = links.Link(gbps, 0.0).seconds(fraction * fp16 * t)
            row[f"scd_ttft_{gbps}gbps_ms"] = 1000 * (consumer + wire)
            row[f"raw_fp16_ttft_{gbps}gbps_ms"] = 1000 * (token0 + links.Link(gbps, 0.0).seconds(fp16 * t))
            row[f"speedup_{gbps}gbps"] = oracle / (consumer + wire)
        return row

"""Link and TTFT model: time to move a payload, and an analytic projection for large models.

Modelled TTFT of a transfer method = link time (latency + bytes / bandwidth) + the
consumer's *measured* compute; the oracle's TTFT is the consumer's measured prefill.
``project`` gives the same comparison for named large configurations on a named GPU
from FLOP counts; it is an analytic projection, not a measurement. No models here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A network link between producer and consumer."""

    gbps: float  # bandwidth in Gbit/s
    latency_s: float = 0.0005  # one-way latency in seconds

    def seconds(self, n_bytes: float) -> float:
        """Transfer time of ``n_bytes``."""
        return self.latency_s + n_bytes * 8 / (self.gbps * 1e9)

    @property
    def label(self) -> str:
        """Short name such as '10gbps'."""
        return f"{self.gbps:g}gbps"


PRESETS = (Link(1), Link(10), Link(25), Link(100))


def ttft(payload_bytes: float, consumer_seconds: float, link: Link) -> float:
    """Modelled time to first token of a transfer method."""
    return link.seconds(payload_bytes) + consumer_seconds


@dataclass(frozen=True)
class ModelShape:
    """What the projection needs to know about a model."""

    name: str  # display name
    layers: int  # decoder layers
    kv_heads: int  # KV heads
    head_dim: int  # per-head dimension
    hidden: int  # hidden size d
    params: float  # parameter count

    @property
    def kv_bytes_per_token(self) -> int:
        """fp16 K+V bytes per token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class GPU:
    """An accelerator for the projection."""

    name: str  # display name
    tflops: float  # dense bf16 peak, TFLOP/s
    mfu: float = 0.5  # fraction of peak a prefill reaches


LARGE_MODELS = (
    ModelShape("Mistral-7B", 32, 8, 128, 4096, 7.2e9),
    ModelShape("Llama-3-8B", 32, 8, 128, 4096, 8.0e9),
    ModelShape("Qwen-32B", 64, 8, 128, 5120, 32.5e9),
)
GPUS = (GPU("A100-80GB", 312.0), GPU("H100-SXM", 989.0))


def project(
    model: ModelShape,
    gpu: GPU,
    prompt_tokens: int,
    compression: float,
    consumer_flops_per_token: float,
    link: Link,
) -> dict:
    """Projected oracle prefill vs a transfer method on ``model`` / ``gpu`` (labelled a projection).

    compression: fp16 KV bytes / method bytes (as measured on the small pair);
    consumer_flops_per_token: the method's consumer-side FLOPs per prompt token (decode
    codes, aligners, recompute), scaled to this model by the caller.
    """
    rate = gpu.tflops * 1e12 * gpu.mfu
    prefill = 2 * model.params * prompt_tokens / rate
    step = 2 * model.params / rate
    payload = model.kv_bytes_per_token * prompt_tokens / compression
    method = link.seconds(payload) + consumer_flops_per_token * prompt_tokens / rate + step
    return {
        "row": "projection",
        "model": model.name,
        "gpu": gpu.name,
        "prompt_tokens": prompt_tokens,
        "link_gbps": link.gbps,
        "oracle_ttft_s": prefill + step,
        "method_ttft_s": method,
        "speedup": (prefill + step) / method,
    }

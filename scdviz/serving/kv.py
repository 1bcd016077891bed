"""The engine's paged KV layout, prefix keys and the file store a connector moves payloads through.

Needs only torch: it runs in the engine's venv (inside the connector) and in the project's environment (tests).

**The CPU layout** (vLLM 0.32 ``CPU_ATTN``, the ``vec`` kernels it picks for float32 on x86 without AMX; found by
comparing the paged cache with transformers' own K / V of the same tokens, and checked by ``tests/engine``): each
attention layer owns one tensor declared ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, which the
kernels view as ``[num_blocks, num_kv_heads, 2 * block_size, head_dim]`` split at ``block_size``
(``cpu_attn.py``). Within one block and one head the first ``block_size * head_dim`` numbers are the block's
keys **transposed**, ``[head_dim, block_size]`` (dimension-major: a key's dimensions are ``block_size`` apart),
and the next ``block_size * head_dim`` its values ``[block_size, head_dim]`` (token-major). So neither "K and V side
by side on the last axis" nor "keys token-major" holds; a copy of whole blocks (vLLM's example connector) is right
whatever the reading, a copy or a decode of single tokens is not. Other kernels (``amx`` for bfloat16 on AMX
CPUs, ``vec16``) are not checked: ``scdviz.serving.connector`` refuses them.

**Matching**: a scheduler may take only whole blocks from outside and must leave at least one prompt token to
compute, so a prompt of N tokens can take at most ``floor((N - 1) / block_size) * block_size`` tokens; the
stored prefix taken is the longest multiple of the block size up to that whose key is in the store.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor


def split(kv_layer: Tensor) -> tuple[Tensor, Tensor]:
    """A layer's paged cache ``[blocks, Hkv, bs, 2D]`` as the ``vec`` kernels hold it: keys ``[blocks, Hkv, D, bs]``
    (transposed) and values ``[blocks, Hkv, bs, D]``, both views (writes land in the cache)."""
    n, h, bs, two_d = kv_layer.shape
    d = two_d // 2
    flat = kv_layer.view(n, h, 2 * bs * d)
    return flat[..., : bs * d].view(n, h, d, bs), flat[..., bs * d:].view(n, h, bs, d)


def gather(kv_layer: Tensor, block_ids: Sequence[int], n_tokens: int) -> tuple[Tensor, Tensor]:
    """Keys and values (Hkv, n_tokens, D) of a request's first ``n_tokens`` tokens, which lie in ``block_ids``
    (its block table, in order); copies."""
    keys_t, values = split(kv_layer)
    bs = kv_layer.shape[2]
    need = -(-n_tokens // bs)
    if need > len(block_ids):
        raise ValueError(f"{n_tokens} tokens need {need} blocks of {bs}, the request has {len(block_ids)}")
    idx = torch.as_tensor(list(block_ids[:need]), dtype=torch.long, device=kv_layer.device)
    k = keys_t.index_select(0, idx).permute(1, 0, 3, 2)  # (Hkv, nb, bs, D)
    v = values.index_select(0, idx).permute(1, 0, 2, 3)
    h, d = k.shape[0], k.shape[3]
    return k.reshape(h, need * bs, d)[:, :n_tokens], v.reshape(h, need * bs, d)[:, :n_tokens]


def scatter(kv_layer: Tensor, block_ids: Sequence[int], keys: Tensor, values: Tensor) -> None:
    """Write keys and values (Hkv, n, D), n a whole number of blocks, into ``block_ids`` (in order), in place."""
    keys_t, vals = split(kv_layer)
    bs = kv_layer.shape[2]
    h, n, d = keys.shape
    if n % bs or n // bs > len(block_ids):
        raise ValueError(f"{n} tokens are not whole blocks of {bs} within {len(block_ids)} blocks")
    nb = n // bs
    idx = torch.as_tensor(list(block_ids[:nb]), dtype=torch.long, device=kv_layer.device)
    keys_t[idx] = keys.to(kv_layer.dtype).reshape(h, nb, bs, d).permute(1, 0, 3, 2)
    vals[idx] = values.to(kv_layer.dtype).reshape(h, nb, bs, d).permute(1, 0, 2, 3)


def matchable(n_prompt: int, block_size: int) -> int:
    """The most tokens of an ``n_prompt``-token prompt an engine may take from outside: whole blocks, leaving
    at least one token to compute."""
    return max(0, (n_prompt - 1) // block_size * block_size)


def prefix_key(channel: str, token_ids: Sequence[int]) -> str:
    """The store key of a prefix: a hash of the channel (what the payload is: raw KV, or SCD of one calibration
    and plan, and the producer) and the token ids. Safe as a file name."""
    h = hashlib.sha256(channel.encode() + b"\0")
    h.update(torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()[:40]


class Store:
    """Payloads in a shared folder, one file per prefix key, written atomically (another process never reads a
    partial file). The folder is the transport between the producer's and a specialist's engine processes."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.scd"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def put(self, key: str, blob: bytes) -> int:
        tmp = self.folder / f".{key}.{os.getpid()}.partial"
        tmp.write_bytes(blob)
        os.replace(tmp, self.path(key))
        return len(blob)

    def get(self, key: str) -> bytes:
        return self.path(key).read_bytes()

    def longest(self, channel: str, token_ids: Sequence[int], block_size: int) -> int:
        """The longest stored prefix of ``token_ids`` (a multiple of ``block_size``, at most ``matchable``), 0
        when none is stored."""
        for n in range(matchable(len(token_ids), block_size), 0, -block_size):
            if self.has(prefix_key(channel, token_ids[:n])):
                return n
        return 0

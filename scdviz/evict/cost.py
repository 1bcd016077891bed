"""What every eviction method costs, measured alike (``bench cost``): one process, one run, one harness.

For each context length, one context (from the ``slice`` of a corpus's eval split) is run by every
method in ``scdviz.timing``'s interleaved rounds (warm-up, then ``rounds`` rounds, the order
shuffled per round; medians with interquartile ranges). One trial of a method is what a server
would run:

- **prefill**: the method's whole prefill, scoring and pruning inside the timer: the full cache is a
  plain prefill with SDPA attention (the denominator of every ratio); a kvpress press runs kvpress's
  own way (``hf.press_prefill``), with SDPA, or eager attention for a scorer that reads attention
  probabilities (ObservedAttention, DistillCache); a student (StudentPress) with SDPA; a lookahead
  policy runs its observation (eager prefill with the feature hooks and its sampled continuations),
  the MLP and the pruning;
- **decode**: ``decode_steps`` greedy tokens from the pruned cache with SDPA attention (per token:
  the time between the first and the last step over the steps between them, so the cache copy
  ``hf.generate`` makes is outside);
- **decode while evicting** (methods that can hold a cache at its budget while decoding: the per-head
  policies without lookahead and ``bench.DECODE_BASELINES``): the same tokens with
  ``DecodeEvictor`` holding the cache at the budget, every bookkeeping step and the eager attention
  it needs inside the timer (a student needs none: SDPA, its arrival scores kept beside the cache; a
  student with a window: ``hf.ROWS``, attention that also returns the decode step's attention row).

Rows: one per (context length, method): ``prefill_ms`` and its IQR, ``added_ttft_ms`` (the method's
prefill minus the full cache's: what a user waits for beyond a plain prefill), ``prefill_ratio``,
``decode_ms_per_token``, ``throughput_vs_full`` (the full cache's decode time per token over the
method's), ``evicting_ms_per_token`` and ``added_ms_per_token`` (minus the full cache's), and the
tokens kept (per full-attention layer and KV head: sliding-window layers are never compressed, and a model with
them says so in ``tokens_kept_in``; a model whose every layer is sliding is refused, ``scdviz.evict.windows``). A
method that cannot run on the model is one row saying why.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from scdviz import data, protocol, timing
from scdviz.config import opt
from scdviz.evict import bench, kvpress_limits, windows
from scdviz.evict.context import observe, prune, why_not
from scdviz.evict.decode import DECODE_WINDOW, DecodeEvictor
from scdviz.evict.policy import Policy, keep_count
from scdviz.evict.press import DistillCachePress
from scdviz.evict.student import StudentPress
from scdviz.models import hf

EAGER = frozenset({"ObservedAttention"})  # kvpress scorers that read attention probabilities
FULL = "full cache"


@dataclass
class CostConfig:
    """One cost run."""

    policies: tuple[str, ...] = opt((), "policy files; empty: the shipped ones")
    corpus: str = opt("austen", "shipped corpus whose eval text gives the contexts (timing does not depend on it much)")
    slice: str = opt("dev", "the slice of its eval split the contexts come from", choices=data.SLICES)
    context_lens: tuple[int, ...] = opt((2048, 4096), "context lengths timed (one context each)")
    keep: float = opt(0.25, "kept fraction of the context")
    decode_steps: int = opt(32, "greedy tokens timed per decode trial (at least 3)")
    decode_interval: int = opt(8, "decode-time eviction every this many new tokens")
    rounds: int = opt(5, "timed rounds (each runs every method once, in a shuffled order)")
    warmup: int = opt(1, "untimed rounds first")
    natives: bool = opt(True, "also kvpress's presses that are not plain scorers (PyramidKV, KVzip, AdaKV, ...)")
    seed: int = opt(0, "order of the methods in each round, the Random press, the lookahead's samples")


@dataclass
class _Method:
    """How one method prefills (and, when it can, evicts while decoding)."""

    name: str
    press: object = None  # a kvpress press for hf.press_prefill
    attn: str = "sdpa"  # the prefill's attention
    policy: Policy | None = None  # a lookahead policy (observe + MLP + prune)
    evictor: object = None  # a scorer DecodeEvictor can use while decoding
    evict_attn: str = "eager"  # attention while evicting (a student reads no attention probabilities)


def methods(cfg: CostConfig, n_keep: int, prefix: int) -> list[_Method]:
    """The full cache, every kvpress scorer, the natives (``cfg.natives``) and every policy, at ``n_keep`` of
    ``prefix`` tokens."""
    ratio = 1.0 - n_keep / prefix
    out = [_Method(FULL)]
    for name, press in bench.baselines(cfg.seed).items():
        press.compression_ratio = ratio
        out.append(_Method(name, press, "eager" if name in EAGER else "sdpa",
                           evictor=press if name in bench.DECODE_BASELINES else None))
    if cfg.natives:
        out += [_Method(name, make(ratio)) for name, make in bench.native_baselines().items()]
    for name, policy in bench.load_policies(cfg.policies).items():
        if policy.config.lookahead:
            out.append(_Method(name, policy=policy, attn="eager"))
            continue
        press = DistillCachePress.keeping(policy, n_keep / prefix)
        out.append(_Method(name, press, "eager", evictor=press if policy.config.per_head else None))
    for name, student in bench.load_students(cfg.policies).items():  # continues from its own prefill's scores
        press = StudentPress.keeping(student, n_keep / prefix)
        rows = hf.ROWS if student.config.window else "sdpa"  # a window reads the decode steps' attention rows
        out.append(_Method(name, press, "sdpa", evictor=press, evict_attn=rows))
    return out


def _decode(model, cache, first: torch.Tensor, start: int, steps: int, device) -> float:
    """Seconds per token of greedy decoding from ``cache``, between the first and the last step."""
    stamps: list[float] = []
    hf.generate(model, cache, first, start, steps, on_step=lambda _c, _s: stamps.append(timing.clock(device)))
    stamps.append(timing.clock(device))  # the last step (generate calls on_step between steps)
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def _trial(model, method: _Method, ids: torch.Tensor, prefix: int, n_keep: int, cfg: CostConfig,
           kept: dict[str, float]) -> dict:
    """One run of ``method``: seconds of its prefill, per decoded token, per token while evicting; the
    tokens a press's cache keeps per head go to ``kept``."""
    device = hf.device_of(model)
    first, context = ids[:, prefix : prefix + 1], ids[:, :prefix]
    out = {}
    if method.name == FULL or method.policy is not None:
        with hf.attention(model, method.attn):
            t0 = timing.clock(device)
            if method.policy is None:
                cache = hf.decoder_cache(model, context)
            else:
                view = method.policy.config.observation  # (window, lookahead G, samples K)
                obs = observe(model, context, view[0], lookahead=view[1:], seed=cfg.seed)
                kept = bench.method_indices(obs, {view: obs}, {method.name: method.policy.to(device)}, "", n_keep)
                cache = prune(model, obs, kept[method.name])
            out["prefill"] = timing.clock(device) - t0
        with hf.attention(model, "sdpa"):
            out["decode"] = _decode(model, cache, first, prefix, cfg.decode_steps, device)
        return out
    kvpress_limits.check(method.press, model, eager=method.attn == "eager")  # refused, not run wrong
    t0 = timing.clock(device)
    with hf.press_prefill(model, method.press, context, method.attn) as cache:
        out["prefill"] = timing.clock(device) - t0
        out["decode"] = _decode(model, cache, first, prefix, cfg.decode_steps, device)
        kept[method.name] = windows.kept_per_head(model, cache)
    if method.evictor is not None:
        evictor = DecodeEvictor(method.evictor, budget=n_keep, window=DECODE_WINDOW,
                                interval=cfg.decode_interval)
        with hf.attention(model, method.evict_attn), evictor(model):
            out["evicting"] = _decode(model, cache, first, prefix, cfg.decode_steps, device)
    return out


def run(cfg: CostConfig, model, tokenizer, progress: bool = True) -> list[dict]:
    """Rows of every method at every context length (module docstring)."""
    if cfg.decode_steps < 3:
        raise ValueError(f"--decode-steps must be at least 3 (per-token time is taken between steps), not "
                         f"{cfg.decode_steps}")
    if not 0 < cfg.keep < 1:
        raise ValueError(f"--keep must be a kept fraction between 0 and 1, not {cfg.keep}")
    protocol.check_slice(cfg.slice)
    windows.compressed_layers(model)  # a model of sliding-window layers only has nothing to compress: refused
    counted = {"tokens_kept_in": windows.counted(model)} if windows.window_layers(model) else {}
    rows, rng = [], random.Random(cfg.seed)
    for length in cfg.context_lens:
        [window] = data.eval_windows(tokenizer, cfg.corpus, cfg.slice, length + 1, 1)
        ids = hf.ids_tensor(window.ids, hf.device_of(model))
        n_keep = keep_count(length, cfg.keep)
        lineup = {m.name: m for m in methods(cfg, n_keep, length)}
        failed: dict[str, str] = {}
        kept: dict[str, float] = {FULL: float(length)}
        bar = tqdm(total=(cfg.warmup + cfg.rounds) * len(lineup), desc=f"cost at {length} tokens",
                   disable=not progress)

        def trial(name: str, ids=ids, length=length, n_keep=n_keep, lineup=lineup, failed=failed, kept=kept,
                  bar=bar) -> dict:
            bar.update()
            if name in failed:
                return {}
            try:
                return _trial(model, lineup[name], ids, length, n_keep, cfg, kept)
            except Exception as err:  # a method that cannot run on this model: reported, never fatal
                failed[name] = why_not(err)
                return {}

        samples = timing.interleaved(trial, list(lineup), cfg.rounds, cfg.warmup, rng)
        bar.close()
        rows += [r | counted if "tokens_kept" in r else r for r in
                 _rows(samples, lineup, failed, length, {name: kept.get(name, n_keep) for name in lineup},
                       window.cluster)]
    return rows


def _rows(samples: dict, lineup: dict, failed: dict, length: int, kept: dict[str, float], passage: str) -> list[dict]:
    """One row per method from the rounds' samples (medians; ratios against the full cache's medians);
    ``kept``: tokens each method keeps per head."""
    q = timing.summary(samples)
    full_prefill, full_decode = q[FULL, "prefill"][1], q[FULL, "decode"][1]
    out = []
    for name in lineup:
        base = {"context_len": length, "method": name, "passage": passage}
        if name in failed or (name, "prefill") not in q:
            out.append(base | {"cannot_run": failed.get(name, "no timing")})
            continue
        lo, med, hi = q[name, "prefill"]
        decode = q[name, "decode"][1]
        row = base | {
            "tokens_kept": round(kept[name], 2),
            "prefill_ms": timing.ms(med), "prefill_iqr_ms": [timing.ms(lo), timing.ms(hi)],
            "added_ttft_ms": timing.ms(med - full_prefill), "prefill_ratio": round(med / full_prefill, 3),
            "decode_ms_per_token": timing.ms(decode),
            "decode_iqr_ms": [timing.ms(v) for v in (q[name, "decode"][0], q[name, "decode"][2])],
            "throughput_vs_full": round(full_decode / decode, 3),
            "evicting_ms_per_token": None, "added_ms_per_token": None, "rounds": len(samples[name, "prefill"])}
        if (name, "evicting") in q:
            ev = q[name, "evicting"]
            row |= {"evicting_ms_per_token": timing.ms(ev[1]), "evicting_iqr_ms": [timing.ms(ev[0]), timing.ms(ev[2])],
                    "added_ms_per_token": timing.ms(ev[1] - full_decode)}
        out.append(row)
    return out

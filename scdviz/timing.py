"""The one timing harness every cost number goes through (``bench ttft``, ``bench cost``, the GPU check).

A cost is only comparable with another measured the same way, in the same process and run: so
every method's steps are timed in *rounds*; each round runs every method once, in an order
shuffled per round (machine noise, caches and clock changes then hit every method alike), after
``warmup`` untimed rounds; a result is the median over rounds, with its interquartile range.

- ``interleaved(trial, names, rounds, warmup, rng)`` runs the rounds: ``trial(name)`` runs method
  ``name`` once and returns the seconds of each of its timed parts (e.g. {"prefill": .., "decode": ..});
- ``clock(device)`` is the time stamp a trial takes around a part: on CUDA it waits for the device first,
  so a part's time includes the kernels it launched;
- ``quantiles`` / ``summary`` turn samples into (q1, median, q3).

It knows no model or method: the callers' trials do the work.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence


def clock(device=None) -> float:
    """``time.perf_counter()`` after every queued kernel of ``device`` (a CUDA device; anything else: none) ran."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed(fn: Callable, *args, device=None) -> tuple[float, object]:
    """(seconds, result) of ``fn(*args)``, clocked with ``clock(device)``."""
    t0 = clock(device)
    out = fn(*args)
    return clock(device) - t0, out


def interleaved(trial: Callable[[str], dict[str, float]], names: Sequence[str], rounds: int, warmup: int,
                rng: random.Random) -> dict[tuple[str, str], list[float]]:
    """(name, part) -> seconds of each timed round: ``warmup`` untimed rounds, then ``rounds`` timed ones,
    each running ``trial(name)`` once for every name in an order ``rng`` shuffles per round."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be at least 1 and warm-up rounds at least 0, got {rounds} and {warmup}")
    samples: dict[tuple[str, str], list[float]] = {}
    for r in range(warmup + rounds):
        order = list(names)
        rng.shuffle(order)
        for name in order:
            parts = trial(name)
            if r >= warmup:
                for part, seconds in parts.items():
                    samples.setdefault((name, part), []).append(seconds)
    return samples


def quantiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); all three the value itself for one value."""
    if not values:
        raise ValueError("no timings")
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def summary(samples: dict[tuple[str, str], list[float]]) -> dict[tuple[str, str], tuple[float, float, float]]:
    """``quantiles`` of every (name, part)."""
    return {key: quantiles(v) for key, v in samples.items()}


def ms(seconds: float) -> float:
    """Seconds as milliseconds, to 0.1 ms (the records' unit)."""
    return round(1000 * seconds, 1)

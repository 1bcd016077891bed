"""Time to first token, measured: every transfer method against the consumer's own prefill.

For each prompt, after ``warmup`` rounds, ``reps`` rounds each time every step of every method
once, in an order shuffled per round (``scdviz.timing``, the harness every cost goes through):
the producer's prefill (decoder only, like the oracle's: the hidden states a method sends are
kept by the same pass in a real server; here they are captured by an untimed extra pass), each
method's encoding (producer side), receiving (consumer side:
parse, decode codes, align, regenerate, recompute, token 0) and first decode step, and the
oracle's prefill + first step. Medians (and interquartile ranges) over rounds and prompts.
A calibration with a trained correction stage (scdviz.scd.distil) has every code-sending plan
timed again with its closed form (``plans.with_closed_form``), interleaved in the same rounds:
``receive_vs_closed_form`` is what the correction adds to receiving.

TTFT at a bandwidth = encoding + payload bytes over the link + receiving + first step,
counted three ways: without the producer's prefill (the producer's cache already exists),
with it, and with it shared by ``fan_out`` specialists (one producer prefill per prefix,
amortised). Break-even bandwidth: the slowest link at which the method still reaches its
first token before the oracle (it wins on any faster link); none when its compute alone
is slower than the oracle's prefill. Link latency is not counted (0 ms).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pandas as pd
from tqdm.auto import tqdm

from scdviz import data, protocol, timing
from scdviz import link as links
from scdviz.config import opt
from scdviz.models import builtin, hf
from scdviz.models.pair import Pair
from scdviz.scd import calibration, transfer
from scdviz.scd import plan as plans

BANDWIDTHS = (1.0, 10.0, 100.0)  # Gbit/s


@dataclass
class TtftConfig:
    """One TTFT measurement run."""

    domain: str | None = opt(None, "shipped corpus whose eval split gives the prompts (default: the specialist's own)")
    texts: str | None = opt(None, "your text (.txt / .jsonl file, or a folder of train/calib/eval files); its eval "
                            "split gives the prompts instead")
    slice: str = opt("dev", "the slice of the eval split the prompts come from (timing hardly depends on the text)",
                     choices=data.SLICES)
    limit: int = opt(3, "prompts")
    prompt_len: int = opt(1024, "prompt tokens per window")
    warmup: int = opt(1, "untimed rounds first")
    reps: int = opt(5, "timed rounds (each times every method once, in a shuffled order)")
    budget: float = opt(3840.0, "also the transform-coded plan and the rate-distortion plan (packed and entropy coded) "
                        "at this many payload bytes/token")
    fan_out: int = opt(4, "specialists sharing one producer prefill (the shared-prefix column)")
    seed: int = opt(0, "order of the methods in each round")


def methods(calib: calibration.Calibration, budget: float, n_tokens: int) -> list[plans.Plan]:
    """The lineup, and at ``budget`` the transform-coded plan and the rate-distortion plan packed and entropy coded."""
    rd = plans.rd_plan(calib.rate, budget, n_tokens)[0] if calib.rate is not None else None
    extra = [] if rd is None else [plans.tc_plan(calib, budget), rd,
                                   dataclasses.replace(rd, name=f"SCD RD+entropy @{budget:g} B/token", entropy=True)]
    return [*plans.lineup(calib), *extra]


def run(cfg: TtftConfig, pair: Pair, calib: calibration.Calibration, progress: bool = True) -> pd.DataFrame:
    """One row per method (oracle first): medians of every timed step and the TTFT columns."""
    if cfg.reps < 1 or cfg.limit < 1:
        raise ValueError("--reps and --limit must be at least 1")
    protocol.check_slice(cfg.slice)
    name = calibration.specialist_name(pair.consumer_source)
    domain = cfg.domain or builtin.training_corpus(name) or (calib.stats.get("domains") or data.corpora())[0]
    windows = [w.ids for w in data.eval_windows(pair.tokenizer, data.USER if cfg.texts else domain, cfg.slice,
                                                cfg.prompt_len + 1, cfg.limit, cfg.texts)]
    rng = random.Random(cfg.seed)
    samples: dict[tuple[str, str], list[float]] = {}
    sizes: dict[str, float] = {}
    device = hf.device_of(pair.consumer)
    n = cfg.prompt_len
    plan_list, calibs = plans.with_closed_form(methods(calib, cfg.budget, n), calib)
    by_name = {p.name: (p, c) for p, c in zip(plan_list, calibs, strict=True)}
    for window in tqdm(windows, desc="ttft: interleaved rounds per prompt", disable=not progress):
        prefix = hf.ids_tensor(window[: cfg.prompt_len], device)
        fed = hf.ids_tensor(window[cfg.prompt_len :], device)
        state = transfer.producer_state(pair.producer, prefix)  # what every method sends from (untimed)

        def trial(item: str, prefix=prefix, fed=fed, state=state) -> dict[str, float]:
            if item == "producer prefill":  # timed like the oracle's: the decoder over the prompt, no LM head
                return {"prefill": timing.timed(hf.decoder_cache, pair.producer, prefix, device=device)[0]}
            if item == "oracle":
                seconds, cache = timing.timed(hf.decoder_cache, pair.consumer, prefix, device=device)
                return {"prefill": seconds, "first_step": transfer.first_step_seconds(pair.consumer, cache, fed, n)}
            plan, its = by_name[item]
            seconds, blob = timing.timed(transfer.build_payload, state, plan, its, device=device)
            got = transfer.receive(pair.consumer, blob, its)
            sizes[item] = len(blob) / n
            return {"encode": seconds, "receive": got.seconds,
                    "first_step": transfer.first_step_seconds(pair.consumer, got.cache, fed, n)}

        names = ["producer prefill", "oracle", *[p.name for p in plan_list]]
        for key, values in timing.interleaved(trial, names, cfg.reps, cfg.warmup, rng).items():
            samples.setdefault(key, []).extend(values)
    return timing_table(samples, sizes, [p.name for p in plan_list], cfg.fan_out, len(windows) * cfg.reps,
                        cfg.prompt_len)


def timing_table(samples, sizes, names, fan_out: int, n: int, prompt_len: int) -> pd.DataFrame:
    med = {key: q[1] for key, q in timing.summary(samples).items()}
    producer = med["producer prefill", "prefill"]
    oracle = med["oracle", "prefill"] + med["oracle", "first_step"]
    rows = [{"method": "oracle", "bytes_per_token": 0.0, "oracle_ms": round(1000 * oracle, 1)}]
    for name in names:
        compute = med[name, "encode"] + med[name, "receive"] + med[name, "first_step"]
        per_token = sizes[name]
        row = {"method": name, "bytes_per_token": round(per_token, 1),
               "encode_ms": round(1000 * med[name, "encode"], 1), "receive_ms": round(1000 * med[name, "receive"], 1),
               "first_step_ms": round(1000 * med[name, "first_step"], 1)}
        q1, _, q3 = timing.quantiles([a + b + c for a, b, c in zip(samples[name, "encode"], samples[name, "receive"],
                                                            samples[name, "first_step"])])
        row["compute_iqr_ms"] = f"[{1000 * q1:.0f}, {1000 * q3:.0f}]"
        for label, extra in (("", 0.0), ("_with_prefill", producer), (f"_shared{fan_out}", producer / fan_out)):
            for gbps in BANDWIDTHS:
                link = links.Link(gbps, 0.0).seconds(per_token * prompt_len)
                row[f"ttft{label}_{gbps:g}gbps_ms"] = round(1000 * (compute + extra + link), 1)
            spare = oracle - compute - extra
            row[f"break_even{label}_gbps"] = round(per_token * prompt_len * 8 / spare / 1e9, 3) if spare > 0 else None
        rows.append(row)
    receive = {r["method"]: r["receive_ms"] for r in rows[1:]}
    for row in rows[1:]:  # a trained correction's cost: receiving against its closed-form twin's (same run)
        twin = receive.get(row["method"] + plans.CLOSED)
        row["receive_vs_closed_form"] = round(row["receive_ms"] / twin, 3) if twin else None
    df = pd.DataFrame(rows)
    df["producer_prefill_ms"] = round(1000 * producer, 1)
    df["oracle_ms"] = round(1000 * oracle, 1)
    df["timings_per_step"] = n
    return df

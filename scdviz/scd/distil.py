"""SCD's correction stage trained through the consumer on what it outputs (issue 31, part 1).

The closed-form calibration (scdviz.scd.calibrate) fits every REUSE map to squared error of K / V
rows, a proxy; the benches score KL(oracle ‖ method) of the consumer's continuation. This stage
adds, per code layer, a correction of the refined decoded rows x = [K_pre, V] (D = 2 d_kv):

    y = x (1 + s) + ((x / sigma) a b) sigma        a: (D, r), b: (r, D), s: (D,), sigma: the rows' spread

with b and s starting at 0, so training starts at the closed form exactly. Input and output are in units
of each column's spread (sigma, which differs widely across columns), so one optimiser step moves every
column by the same relative amount (the stored output scale is ``tau``). It is trained by
backpropagation through the frozen consumer on KL(oracle ‖ method) of teacher-forced
continuations, the quantity the benches report. The payloads it trains on are built at every
operating point it is trained for (quantisation-aware): the calibration's own plan (its code bits)
and the transform-coded plans at ``budgets`` bytes per token (by default 1/6 and 1/10 of the fp16
cache of the built-in producer), one plan per step in turn, so one correction serves them all. It
reads what a consumer receives (decoded codes), never the producer's raw state. Training windows come from
the ``train`` splits, the validation windows that choose the point kept from the ``calib`` splits
(never eval). Gradients are taken with ``torch.autograd.grad``: nothing lands on the shared model.

``distil(pair, calib, cfg)`` returns a new Calibration carrying the corrections (its tag differs,
so payloads of the two never mix) and a log; ``save`` / ``load`` are the calibration's own.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from scdviz import config, data, metrics, qa
from scdviz.config import opt
from scdviz.models import hf
from scdviz.models.pair import Pair
from scdviz.progress import Reporter, steps
from scdviz.scd import plan as plans
from scdviz.scd import transfer
from scdviz.scd.calibration import CORRECTION_FACTORS, Calibration, correction_tensors, domains_of, stored

RECALL_TARGETS = ("oracle", "quote")  # DistilConfig.recall_target
TRAINED = (*CORRECTION_FACTORS, "s")  # a correction's trained tensors: its factors and its scale


@dataclass
class DistilConfig:
    """One training of the correction stage. Defaults: the shipped recipe (docs/design.md): lr 1e-4 chosen by
    calib-split validation KL of three runs on austen-qkv (a specialist since retired: docs/history.md), the
    recall share and target on its dev slice, and the data size (300 training windows a domain, one epoch, 6
    validation windows a domain every 180 steps) chosen over 30 and 90 a domain on its dev slice
    (``research/distil_scale``)."""

    rank: int = opt(32, "rank r of each layer's correction")
    budgets: list[float] = opt([3840.0, 2304.0], "bytes per token of the transform-coded plans trained at, beside the "
                               "calibration's own operating point (needs its rate curves; none: that point only)")
    epochs: int = opt(1, "passes over the training windows (the validated point with the lowest validation "
                      "objective is kept)")
    train_windows: int = opt(300, "training windows per domain (train split)")
    val_windows: int = opt(6, "validation windows per domain (calib split), which choose the point kept")
    prompt_len: int = opt(256, "prompt tokens per window")
    cont_len: int = opt(32, "teacher-forced continuation tokens scored per window")
    lr: float = opt(1e-4, "AdamW learning rate")
    weight_decay: float = opt(0.05, "AdamW weight decay")
    clip: float = opt(1.0, "gradient norm clip")
    recall: float = opt(0.1, "share of the training and validation windows whose continuation asks a context-QA "
                        "question about their own prompt and answers it (scdviz.qa: a question quoting CUE prompt "
                        "tokens, then its answer): a recall term of the objective")
    recall_kind: str | None = opt(None, "the question a recall window asks (scdviz.qa): quote (continue a quote of "
                                  "the prompt) or before (the words before a quote, nearest first); default: the "
                                  "task the consumer was fine-tuned on when it is one of these, else quote (as "
                                  "bench scd asks)")
    recall_target: str = opt("quote", "what a recall window's quoted tokens are scored against: 'oracle' (KL to "
                             "the consumer with its own cache, as every other token) or 'quote' (their negative "
                             "log-likelihood, less the oracle's: the quote itself is the truth, and the oracle's "
                             "own recall is below raw reuse's on both built-in specialists)",
                             choices=RECALL_TARGETS)
    val_every: int = opt(180, "training steps between validations (0: after each epoch); the corrections kept are "
                         "the validated ones with the lowest KL")
    seed: int = opt(0, "initialisation and window order")

    def __post_init__(self) -> None:
        if self.val_every < 0:
            raise ValueError(f"--val-every is a number of steps (0: after each epoch), got {self.val_every}")
        for name in ("rank", "epochs", "train_windows", "val_windows", "prompt_len", "cont_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.recall <= 1:
            raise ValueError(f"--recall is a share of the windows, from 0 to 1; got {self.recall}")
        if self.recall_kind is not None and self.recall_kind not in qa.KINDS:
            raise ValueError(f"--recall-kind is one of {qa.KINDS}, got {self.recall_kind!r}")
        if self.recall_target not in RECALL_TARGETS:
            raise ValueError(f"--recall-target is 'oracle' or 'quote', got {self.recall_target!r}")
        if any(not b > 0 for b in self.budgets):
            raise ValueError(f"--budgets must be positive bytes per token, got {self.budgets}")


def trained_plans(calib: Calibration, cfg: DistilConfig) -> list[plans.Plan]:
    """The operating points the correction is trained at: the calibration's own plan, then the
    transform-coded plan at each of ``cfg.budgets``."""
    if cfg.budgets and calib.rate is None:
        raise ValueError("--budgets trains at transform-coded plans, which need the calibration's rate curves: run "
                         "`python -m scdviz rate` on it first, or pass --budgets with no value")
    return [plans.operating_plan(calib)] + [plans.tc_plan(calib, b) for b in cfg.budgets]


def windows(pair: Pair, calib: Calibration, cfg: DistilConfig) -> tuple[list[list[int]], list[list[int]]]:
    """(training windows from the train splits, validation windows from the calib splits) of the
    calibration's domains, ``prompt_len + cont_len`` tokens each, spread through each split; ``cfg.recall``
    of each domain's windows continue with a quote of their own prompt instead (``quoted``)."""
    return tuple([w for _, w, _ in split] for split in named_windows(pair, calib, cfg))


def spread_order(count: int, n: int) -> list[int]:
    """The first ``n`` of ``count`` windows in an order whose every prefix is spread through them: index
    floor(count * v_k) for the base-2 van der Corput sequence v_0, v_1, ... (0, 1/2, 1/4, 3/4, ...), repeats
    skipped. So 30 windows a domain are the first 30 of 300: a larger training set holds every smaller one."""
    out, seen, k = [], set(), 0
    while len(out) < min(n, count):
        v, x, base = 0.0, k, 0.5
        while x:
            v, x, base = v + base * (x & 1), x >> 1, base / 2
        k += 1
        if int(count * v) not in seen:
            seen.add(int(count * v))
            out.append(int(count * v))
    return out


def named_windows(pair: Pair, calib: Calibration, cfg: DistilConfig) -> tuple[list, list]:
    """``windows``, each as (its name in a spool: split, domain and place in ``spread_order``, the window,
    whether it is a quote-recall one)."""
    length, train, val = cfg.prompt_len + cfg.cont_len, [], []
    kind = qa.kind_for(pair.consumer_source, cfg.recall_kind)
    for name in domains_of(calib.config):
        for split, n, out in (("train", cfg.train_windows, train), ("calib", cfg.val_windows, val)):
            got = data.token_windows(pair.tokenizer, data.passages(name, split, calib.config.texts), length)
            if len(got) < n:
                raise ValueError(f"{name!r} gives {len(got)} windows of {length} tokens in its {split} split; "
                                 f"need {n}")
            for i, at in enumerate(spread_order(len(got), n)):
                recall = is_recall(i, cfg.recall)
                w = quoted(pair.tokenizer, got[at][: cfg.prompt_len], cfg.cont_len, i, kind) if recall else got[at]
                out.append((f"{split}-{name}-{i:05d}", w, recall))
    return train, val


def quote_from(tokenizer, kind: str = "quote") -> int:
    """Where a recall window's answer starts in its continuation: after its question (``qa.question_tokens``)."""
    return len(qa.question_tokens(tokenizer, kind, [0] * qa.CUE))


def is_recall(i: int, share: float) -> bool:
    """Whether the i-th window of a split is a quote-recall one: ``share`` of them, spread evenly and
    rounded, so a split of n windows has round(n * share) of them (3 validation windows at 0.25: one)."""
    return int((i + 1) * share + 0.5) > int(i * share + 0.5)


def quoted(tokenizer, prompt: list[int], cont_len: int, index: int, kind: str = "quote") -> list[int]:
    """``prompt`` then a continuation of ``cont_len`` tokens that asks a context-QA question of ``kind`` about it and
    answers it (``qa.question_tokens``, then the answer): from a span of the prompt at a position that moves with
    ``index`` through its middle, quote continues the span's first CUE tokens with the rest of it, before quotes its
    last CUE tokens and answers with the ones before them, nearest first (as ``qa.make_item``)."""
    asked = len(qa.question_tokens(tokenizer, kind, [0] * qa.CUE)) - qa.CUE
    copied = cont_len - asked  # the span: the cue and its answer
    if copied < qa.CUE + 1 or copied > len(prompt) // 2:
        raise ValueError(f"--cont-len {cont_len} leaves {copied} quoted tokens; a recall window needs "
                         f"{qa.CUE + 1} to {len(prompt) // 2}")
    span = len(prompt) - copied
    start = span // 4 + (index * 37) % max(1, span // 2)
    got = prompt[start : start + copied]
    if kind == "before":
        n = copied - qa.CUE
        return prompt + qa.question_tokens(tokenizer, kind, got[n:]) + got[:n][::-1]
    return prompt + qa.question_tokens(tokenizer, kind, got[: qa.CUE]) + got[qa.CUE :]


def initial(spread: dict[int, torch.Tensor], rank: int, seed: int) -> dict:
    """The corrections training starts from (the identity: b = s = 0), for each code layer in ``spread``;
    sigma (the input's scale) and tau (the output's): ``spread[layer]``, the spread of each column (D,) of
    that layer's refined rows (``row_spread``)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in sorted(spread):
        sigma = spread[layer].float().cpu().clamp_min(1e-6)  # artefacts live on the host, as the calibration
        d = sigma.shape[0]
        out[layer] = {"a": torch.randn(d, rank, generator=g, device="cpu") / d**0.5,
                      "b": torch.zeros(rank, d, device="cpu"), "s": torch.zeros(d, device="cpu"), "sigma": sigma,
                      "tau": sigma.clone()}
    return out


@dataclass
class Source:
    """A training window as training keeps it: the window's ids, the consumer's own teacher-forced logits of its
    continuation (on the host) and, for a recall window scored against its quote, where the quoted answer starts."""

    ids: torch.Tensor  # (1, L) the window: prompt, then continuation
    logits: torch.Tensor  # (n, V) the consumer's own teacher-forced logits at positions L - 1 - n .. L - 2
    quote: int | None  # a recall window scored against its quote: where the quoted answer starts

    def target(self, device) -> Target:
        """The window's continuation as training scores it, its oracle logits on ``device``."""
        n = self.logits.shape[0]
        start = self.ids.shape[1] - 1 - n
        truth = None if self.quote is None else self.ids[0, start + 1 :]
        return Target(self.ids[:, start : start + n], start, self.logits.to(device).float(), truth, self.quote)


def source(pair: Pair, window: list[int], prompt_len: int, quote: int | None) -> tuple[Source, transfer.ProducerState]:
    """(the ``Source`` of a window of ``prompt_len`` prompt tokens, the producer's state of its prompt): the
    producer's prefill of the prompt less its last token and the consumer's one teacher-forced pass over the
    window."""
    ids = torch.tensor([window], dtype=torch.long, device="cpu")  # host-side ids; hf moves them to the model
    state = transfer.producer_state(pair.producer, ids[:, : prompt_len - 1])
    logits = hf.forward(pair.consumer, ids[:, :-1], last_logits=ids.shape[1] - prompt_len).logits[0]  # continuation
    return Source(ids, logits.detach().to("cpu", torch.float32), quote), state


@dataclass
class Target:
    """What training needs of a prepared case once its payloads are built: the fed tokens, where they
    start, the oracle's logits (a ``transfer.Case`` also holds the producer's state, the oracle's
    cache and residuals: ~20 MB a window, which hundreds of windows cannot keep), and, for a recall window
    scored against its quote, the true continuation and the position its quoted answer starts at."""

    fed: torch.Tensor  # (1, n)
    start: int  # prompt tokens before ``fed``
    oracle_logits: torch.Tensor  # (n, V)
    truth: torch.Tensor | None = None  # (n,) the continuation's tokens, when ``quote`` is set
    quote: int | None = None  # continuation positions from here on are scored by their NLL, not by KL

    @classmethod
    def of(cls, case: transfer.Case, quote: int | None = None) -> Target:
        return cls(case.fed, case.state.ids.shape[1], case.oracle_logits,
                   None if quote is None else case.targets[0], quote)


def continuation_kl(pair: Pair, target: Target, blob: bytes, calib: Calibration, corrections: dict | None,
                    grad: bool):
    """The objective on one window's continuation after ``blob`` with ``corrections``: the mean over its
    tokens of KL(oracle ‖ method), except that a recall window scored against its quote (``Target.quote``)
    counts each quoted token by its NLL less the oracle's (the gradient of the NLL; 0 where the method
    recalls as well as the oracle, below 0 where better)."""
    got = transfer.receive(pair.consumer, blob, calib, corrections)
    positions = torch.arange(target.start, target.start + target.fed.shape[1],
                             device=hf.device_of(pair.consumer)).unsqueeze(0)
    logits = hf.forward(pair.consumer, target.fed, cache=got.cache, positions=positions, grad=grad).logits[0]
    per_token = metrics.kl_per_token(target.oracle_logits, logits)
    if target.quote is not None:
        q = target.quote
        excess = (metrics.nll_per_token(logits[q:], target.truth[q:])
                  - metrics.nll_per_token(target.oracle_logits[q:], target.truth[q:]).to(logits.device))
        per_token = torch.cat([per_token[:q], excess])
    return per_token.mean()


def row_sums(calib: Calibration, blobs) -> dict[int, tuple]:
    """Per code layer, (rows, sum, sum of squares per column) of the [K_pre, V] rows of every payload in ``blobs``
    as ``transfer.receive`` refines them (no correction), in float64, payload by payload, so memory does not grow
    with the payloads (a whole training set's rows are ~35 MB a window)."""
    out: dict[int, tuple] = {}
    for blob in blobs:
        for layer, rows in transfer.code_rows(calib, blob):
            rows = rows.double()
            n, total, squares = out.get(layer, (0, 0.0, 0.0))
            out[layer] = (n + rows.shape[0], total + rows.sum(0), squares + (rows**2).sum(0))
    return out


def spread_of_sums(sums: dict[int, tuple]) -> dict[int, torch.Tensor]:
    """Per code layer, the standard deviation of each column from its ``row_sums``."""
    return {layer: ((sq - t**2 / n) / max(n - 1, 1)).clamp_min(0).sqrt().float() for layer, (n, t, sq) in sums.items()}


def row_spread(calib: Calibration, blobs) -> dict[int, torch.Tensor]:
    """Per code layer, the standard deviation of each column of the refined rows of every payload in ``blobs``."""
    return spread_of_sums(row_sums(calib, blobs))


def footprint(corrections: dict[int, dict[str, torch.Tensor]], consumer_params: int, layers: int) -> dict:
    """What a correction stage costs: its size as saved (bytes, and MB to 3 decimals: the factors as int8 rows with
    an fp16 scale each, the rest float32, tau only where it differs from sigma) and the consumer's FLOPs per
    received prompt token (per corrected layer x (1 + s) is D multiply-adds, (x / sigma) a b is D + 2 D r + 2 r D,
    the output scale D more, with D = 2 d_kv), also as a fraction of the consumer's own prefill (2 x its
    parameters per token)."""
    size = sum(t.nbytes for p in corrections.values() for t in correction_tensors(p).values())  # as saved
    flops = sum(2 * p["s"].numel() + 4 * p["a"].numel() + p["sigma"].numel() + (p["tau"].numel() if "tau" in p else 0)
                for p in corrections.values())
    return {"layers": len(corrections), "of_layers": layers, "bytes": int(size), "mb": round(size / 1e6, 3),
            "flops_per_token": int(flops), "of_prefill": round(flops / (2 * consumer_params), 5)}


def step(opt_: torch.optim.Optimizer, trained: list[torch.Tensor], loss: torch.Tensor, clip: float) -> float:
    """One optimiser step on ``loss`` with the gradient norm clipped to ``clip``; returns the norm before.

    Only the corrections' gradients are taken (``torch.autograd.grad``: the model is shared). A parameter
    the loss does not reach (the correction of a layer this step's plan patches) gets no gradient, not a
    zero one, so AdamW leaves it alone (no weight decay, no momentum step); the clip norm counts only the
    gradients that exist."""
    grads = torch.autograd.grad(loss, trained, allow_unused=True)
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))
    scale = min(1.0, clip / (norm + 1e-12))
    for t, g in zip(trained, grads, strict=True):
        t.grad = None if g is None else g * scale
    opt_.step()
    opt_.zero_grad(set_to_none=True)
    return norm


SPOOL_FORMAT = 1  # a spool's layout (``prepare``); a spool of another format is refused
CHECKPOINT_S = 60.0  # a fit writes its checkpoint at every validation, when stopped, and at least this often


def spool_meta(calib: Calibration, cfg: DistilConfig, at: list[plans.Plan], kind: str = "quote") -> dict:
    """What a spool's prepared windows depend on, beside their names (``kind``: the question its recall windows
    ask): a spool made for other values is refused."""
    return {"format": SPOOL_FORMAT, "calibration": f"{calib.tag:016x}", "plans": [p.name for p in at],
            "prompt_len": cfg.prompt_len, "cont_len": cfg.cont_len, "recall": cfg.recall,
            "recall_target": cfg.recall_target, "texts": str(calib.config.texts),
            **({"recall_kind": kind} if kind != "quote" else {})}  # quote: as spools made before the kinds


def _blob_key(j: int) -> str:
    return f"blob.{j}"


def _write_window(path: Path, src: Source, blobs: list[bytes], sums: dict | None) -> None:
    """One prepared window as a spool file (written whole, then renamed: an interrupted preparation leaves no
    half file): its ids, the oracle's logits (float16 for a training window, float32 for a validation one, which
    chooses the checkpoint), its payload at each plan and, for a training window, its rows' sums per code layer."""
    tensors = {"ids": src.ids.contiguous(), "logits": (src.logits if sums is None else src.logits.half()).contiguous()}
    tensors.update({_blob_key(j): torch.frombuffer(bytearray(b), dtype=torch.uint8) for j, b in enumerate(blobs)})
    for layer, (n, total, squares) in (sums or {}).items():
        count = torch.tensor([float(n)], dtype=torch.float64, device="cpu")  # a host-side artefact, as the sums
        tensors.update({f"n.{layer}": count, f"sum.{layer}": total, f"sq.{layer}": squares})
    tmp = path.with_suffix(".part")
    save_file(tensors, str(tmp), metadata={"quote": "" if src.quote is None else str(src.quote)})
    os.replace(tmp, path)


def _read_window(path: Path, device, plan: int | None = None) -> tuple[Target, list[bytes]]:
    """(the Target of a spool file, its payloads; only plan ``plan``'s, in place, when one is named)."""
    with safe_open(str(path), "pt") as f:
        quote = f.metadata().get("quote", "")
        n = sum(k.startswith("blob.") for k in f.keys())
        blobs = [f.get_tensor(_blob_key(j)).numpy().tobytes() if plan in (None, j) else b"" for j in range(n)]
        src = Source(f.get_tensor("ids"), f.get_tensor("logits").float(), int(quote) if quote else None)
    return src.target(device), blobs


def _spread_of(paths: list[Path]) -> dict[int, torch.Tensor]:
    """``row_spread`` of the training windows' payloads, from the ``row_sums`` their spool files carry."""
    acc: dict[int, tuple] = {}
    for path in paths:
        with safe_open(str(path), "pt") as f:
            for key in (k for k in f.keys() if k.startswith("n.")):
                layer = int(key[2:])
                n, total, squares = acc.get(layer, (0.0, 0.0, 0.0))
                acc[layer] = (n + float(f.get_tensor(key)), total + f.get_tensor(f"sum.{layer}"),
                              squares + f.get_tensor(f"sq.{layer}"))
    return spread_of_sums(acc)


def prepare(pair: Pair, calib: Calibration, cfg: DistilConfig, at: list[plans.Plan], spool: Path,
            progress: bool | Reporter = True, part: tuple[int, int] = (0, 1)) -> tuple[list[Path], list[Path]]:
    """Everything training reads that does not change while it trains, computed once per window and stored in
    ``spool`` (one file a window, ``_write_window``): the producer's payload at each plan, the consumer's own
    logits of the continuation, the rows' sums that set the correction's scale. A window already in the spool is
    not computed again, so an interrupted preparation resumes, and fits with more windows, or another rank,
    learning rate or schedule, share the windows they have in common. ``part`` (i, n): only the i-th of every n
    windows (n processes preparing one spool, one core each). Returns (training files, validation files).
    ValueError when ``spool`` was prepared for another calibration, plans or windows."""
    if not 0 <= part[0] < part[1]:
        raise ValueError(f"part {part[0]} of {part[1]}: the first number counts from 0 to the second less one")
    spool.mkdir(parents=True, exist_ok=True)
    kind = qa.kind_for(pair.consumer_source, cfg.recall_kind)
    meta, meta_path = spool_meta(calib, cfg, at, kind), spool / "meta.json"
    if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
        raise ValueError(f"the spool {spool} was prepared for {json.loads(meta_path.read_text())}, not for {meta}: "
                         "give another spool folder")
    meta_path.write_text(json.dumps(meta, indent=1))
    answer = quote_from(pair.tokenizer, kind) if cfg.recall_target == "quote" else None
    train_w, val_w = named_windows(pair, calib, cfg)
    todo = [(name, w, recall, split == 0) for split, ws in enumerate((train_w, val_w)) for name, w, recall in ws]
    missing = [not (spool / f"{t[0]}.safetensors").exists() for t in todo]
    have = len(todo) - sum(missing)
    todo = [t for i, (t, lacks) in enumerate(zip(todo, missing, strict=True)) if i % part[1] == part[0] and lacks]
    for name, w, recall, training in steps(todo, f"distil: preparing {len(todo)} windows (producer and oracle "
                                           f"prefills, payloads at {len(at)} plans; "
                                           f"{have} already in the spool)", progress):
        with torch.no_grad():
            src, state = source(pair, w, cfg.prompt_len, answer if recall else None)
            blobs = [transfer.build_payload(state, p, calib) for p in at]
            _write_window(spool / f"{name}.safetensors", src, blobs, row_sums(calib, blobs) if training else None)
    return ([spool / f"{name}.safetensors" for name, _, _ in train_w],
            [spool / f"{name}.safetensors" for name, _, _ in val_w])


def _checkpoint_key(calib: Calibration, cfg: DistilConfig, at: list[plans.Plan]) -> dict:
    """What a checkpoint must match to be resumed: the calibration, plans and recipe, less the epochs (a fit may be
    resumed with more)."""
    return {"calibration": f"{calib.tag:016x}", "plans": [p.name for p in at],
            "config": {k: v for k, v in config.to_dict(cfg).items() if k != "epochs"}}


def _save_checkpoint(folder: Path, key: dict, done: int, running: list[float], log: dict, params: dict,
                     opt_: torch.optim.Optimizer, trained: list[torch.Tensor], best: dict) -> None:
    """The fit so far, whole (written, then renamed): the corrections, AdamW's state, the best corrections, the log."""
    tensors = {f"p.{layer}.{k}": v.detach().cpu().contiguous() for layer, p in params.items() for k, v in p.items()}
    tensors.update({f"b.{layer}.{k}": v.contiguous() for layer, p in best.items() for k, v in p.items()})
    for i, t in enumerate(trained):
        for k, v in opt_.state.get(t, {}).items():
            tensors[f"o.{i}.{k}"] = v.detach().cpu().reshape(-1) if k == "step" else v.detach().cpu().contiguous()
    save_file(tensors, str(folder / "checkpoint.part"))
    state = {"key": key, "done": done, "running": running, "log": log}
    (folder / "checkpoint.json.part").write_text(json.dumps(state))
    os.replace(folder / "checkpoint.part", folder / "checkpoint.safetensors")
    os.replace(folder / "checkpoint.json.part", folder / "checkpoint.json")


def _load_checkpoint(folder: Path, key: dict, params: dict, opt_: torch.optim.Optimizer,
                     trained: list[torch.Tensor]) -> tuple[int, list[float], dict, dict] | None:
    """(steps done, the running training loss, the log, the best corrections) of the checkpoint in ``folder``,
    with ``params`` and ``opt_`` set to it; None when there is none. ValueError for one of another fit."""
    if not (folder / "checkpoint.json").exists():
        return None
    state = json.loads((folder / "checkpoint.json").read_text())
    if state["key"] != key:
        raise ValueError(f"{folder} holds the checkpoint of another fit ({state['key']}); give another folder")
    best: dict = {}
    with safe_open(str(folder / "checkpoint.safetensors"), "pt") as f:
        for name in f.keys():
            kind, *rest = name.split(".")
            if kind == "p":
                with torch.no_grad():
                    params[int(rest[0])][rest[1]].copy_(f.get_tensor(name))
            elif kind == "b":
                best.setdefault(int(rest[0]), {})[rest[1]] = f.get_tensor(name)
        for i, t in enumerate(trained):
            if f"o.{i}.step" in f.keys():
                got = {k: f.get_tensor(f"o.{i}.{k}") for k in ("step", "exp_avg", "exp_avg_sq")}
                opt_.state[t] = {k: v.reshape(()) if k == "step" else v.to(t.device) for k, v in got.items()}
    return state["done"], state["running"], state["log"], best


def distil(pair: Pair, calib: Calibration, cfg: DistilConfig, progress: bool | Reporter = True,
           at: list[plans.Plan] | None = None, folder: str | Path | None = None,
           spool: str | Path | None = None) -> tuple[Calibration, dict]:
    """Train the correction stage of ``calib``'s closed form (see the module docstring; a stage ``calib``
    already has is replaced) at the plans ``at`` (default: ``trained_plans``), one plan per step in turn.

    The windows are prepared once into ``spool`` (default ``folder``/spool; ``prepare``) and training streams
    over them. Validation runs after every epoch, or every ``cfg.val_every`` steps; the corrections kept are the
    ones with the lowest validation KL averaged over the plans. ``folder`` (default: a temporary one) holds the
    checkpoint: a fit stopped or killed and called again with the same ``folder`` resumes where its last
    checkpoint was, and ends with the same corrections as one never interrupted. Returns (the calibration with
    the kept corrections, the log); when no validation beats the closed form, the closed form itself (same tag,
    no corrections; the log says so)."""
    if folder is None:
        with tempfile.TemporaryDirectory(prefix="scdviz-distil-") as tmp:
            return _fit(pair, calib, cfg, progress, at, Path(tmp), spool)
    return _fit(pair, calib, cfg, progress, at, Path(folder), spool)


def _fit(pair: Pair, calib: Calibration, cfg: DistilConfig, progress: bool | Reporter, at: list[plans.Plan] | None,
         folder: Path, spool: str | Path | None) -> tuple[Calibration, dict]:
    """``distil`` into ``folder``."""
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    calib = calib.closed_form()  # a calibration trained before starts again from its closed form
    at = at or trained_plans(calib, cfg)
    if not any("code" in p.modes for p in at):
        raise ValueError(f"plans {[p.name for p in at]} send no REUSE codes: there is nothing to correct")
    train_files, val_files = prepare(pair, calib, cfg, at, Path(spool) if spool else folder / "spool", progress)
    device = hf.device_of(pair.consumer)
    val = [_read_window(path, device) for path in val_files]
    start = initial(_spread_of(train_files), cfg.rank, cfg.seed)
    params = {layer: {k: v.to(device).requires_grad_(k in TRAINED) for k, v in p.items()}
              for layer, p in start.items()}
    trained = [t for p in params.values() for k, t in p.items() if k in TRAINED]  # sigma, tau: fixed
    opt_ = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)
    n_train, total_steps = len(train_files), cfg.epochs * len(train_files)
    every = cfg.val_every or n_train

    def validation() -> list[float]:
        """Mean validation KL at each plan."""
        with torch.no_grad():
            kept = stored(params)  # as they would be saved: the factors through int8 rows
            return [sum(float(continuation_kl(pair, target, blobs[j], calib, kept, False))
                        for target, blobs in val) / len(val) for j in range(len(at))]

    def record(by_plan: list[float], done: int) -> None:
        for p, kl in zip(at, by_plan, strict=True):
            log["val_kl_by_plan"][p.name].append(kl)
        log["val_kl"].append(sum(by_plan) / len(by_plan))
        log["val_steps"].append(done)

    key = _checkpoint_key(calib, cfg, at)

    def save() -> None:
        log["seconds"] = round(spent + time.perf_counter() - t0, 1)  # every sitting's, summed
        _save_checkpoint(folder, key, done, running, log, params, opt_, trained, best)

    resumed = _load_checkpoint(folder, key, params, opt_, trained)
    if resumed is None:
        done, running, best = 0, [0.0, 0], {}
        log = {"config": config.to_dict(cfg), "plans": [p.name for p in at], "train_windows": n_train,
               "val_windows": len(val_files),
               "recall_windows": [sum(is_recall(i, cfg.recall) for i in range(n)) * len(domains_of(calib.config))
                                  for n in (cfg.train_windows, cfg.val_windows)],
               "val_kl": [], "val_kl_by_plan": {p.name: [] for p in at}, "val_steps": [], "train_kl": [],
               "best_epoch": 0, "seconds_prepare": round(time.perf_counter() - t0, 1)}
        spent = 0.0
        record(validation(), 0)
        save()
    else:
        done, running, log, best = resumed
        spent = log["seconds"]
        log["config"]["epochs"] = cfg.epochs
        log.setdefault("resumed_at", []).append(done)
    last_saved, validating, order = time.perf_counter(), False, None
    work = range(done, total_steps)
    desc = (f"distil: steps through the consumer ({cfg.epochs} epochs of {n_train} windows, validation every "
            f"{every} steps{f'; resumed at step {done}' if done else ''})")
    try:
        for s in steps(work, desc, progress):
            epoch, n = divmod(s, n_train)
            if n == 0 or order is None:  # each epoch's order, from its number alone (so a resumed fit has it too)
                order = list(range(n_train))
                random.Random(cfg.seed * 1_000_003 + epoch).shuffle(order)
            j = (n + epoch) % len(at)  # the plans in turn: every window meets a different one each epoch
            target, blobs = _read_window(train_files[order[n]], device, j)
            loss = continuation_kl(pair, target, blobs[j], calib, params, True)
            step(opt_, trained, loss, cfg.clip)
            done, running = s + 1, [running[0] + float(loss.detach()), running[1] + 1]
            if done % every and done != total_steps:
                if time.perf_counter() - last_saved > CHECKPOINT_S:
                    save()
                    last_saved = time.perf_counter()
                continue
            validating = True  # a checkpoint now would skip this validation on resume: the last one stands
            by_plan = validation()
            log["train_kl"].append(running[0] / running[1])
            running = [0.0, 0]
            record(by_plan, done)
            if log["val_kl"][-1] < min(log["val_kl"][:-1]):
                log["best_epoch"] = len(log["val_kl"]) - 1
                best = {layer: {k: v.cpu() for k, v in p.items()} for layer, p in stored(params).items()}
            validating = False
            save()
            last_saved = time.perf_counter()
    except BaseException:  # stopped or killed: what was done is kept, and the same call resumes from it
        if not validating:
            save()
        raise
    log["best_step"] = log["val_steps"][log["best_epoch"]]
    log["best_by_plan"] = {name: kls.index(min(kls)) for name, kls in log["val_kl_by_plan"].items()}
    log["seconds"] = round(spent + time.perf_counter() - t0, 1)
    facts = pair.consumer_facts
    log["footprint"] = footprint(best or params, facts.params, facts.layers)
    if not log["best_epoch"]:  # no validation beat the closed form: it is the result, under its own tag
        return calib.closed_form(), log
    out = replace(calib, corrections=best, stats={**calib.stats, "distil": log})  # a new tag: payloads never mix
    return out, log

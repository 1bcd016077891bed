"""Fitting the DistillCache student (``fit``): closed-form distillation, then a listwise stage.

``fit`` distils it in closed form: ridge regression (float64 normal equations, accumulated
context by context) of the teacher's log-score, centred per row (top-B within a row does not
see a row's offset). The teacher (training text only): the attention that ``teacher_len`` tokens
of the text that follows each context pay to each context token over the full cache (the
future, ``features.future_attention``). Decode states (``decode_len``) add rows where
the age term acts: after each context the model generates greedily, and at every
``decode_every``-th generated token each cached token is regressed on the attention the rest of
the generation pays it. The ridge strength is chosen on validation contexts (calib split) by the
KLs the benches report: at prefill (``train.validation_kls``: deterministic top-B, the
continuation teacher-forced after ``question_len`` unscored tokens) plus, with ``val_decode``,
while decoding (``decode_kls``: the cache held at its budget by the same student); then the
listwise stage (``listwise_layer``) refits the chosen closed form on the softmax cross-entropy
to the teacher's attention, kept when it validates better. The CLI saves what it returns
(``Student.save``).

The accumulated sums are what a fit spends its time on and do not change once a context is in them, so
they are checkpointed: ``fit``'s ``folder`` holds them (``checkpoint.safetensors``, float64, and
``checkpoint.json``: the training contexts done, the row counts, the recipe it belongs to) with the
listwise stage's spool (``listwise/``, ``Lists``), and a fit stopped or killed and called again with the
same folder and recipe accumulates only the contexts after its last checkpoint, ending with the same
student, bit for bit, as a fit never interrupted. Without a folder a temporary one is used (inside
``out`` when it is set), deleted when the fit ends.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from kvpress import ObservedAttentionPress
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from scdviz import artefact, config, data
from scdviz.config import opt
from scdviz.evict import features as F
from scdviz.evict import train as trainer
from scdviz.evict.decode import DECODE_WINDOW, DecodeEvictor
from scdviz.evict.policy import keep_count
from scdviz.evict.student import WINDOW_EPS, Student, StudentConfig, StudentPress, window_column
from scdviz.evict.windows import compressed_layers
from scdviz.models import hf
from scdviz.progress import Reporter, steps

CHECKPOINT_EVERY = 10  # training contexts between the closed form's checkpoints (also one when stopped and when done)
CHECKPOINT_S = 300.0  # and at most this many seconds (a large model's contexts are slow on a CPU)
CHECKPOINT_FILES = ("checkpoint.safetensors", "checkpoint.json")  # in a fit's folder, beside its spool (``SPOOL``)
SPOOL = "listwise"  # the listwise stage's spool, in a fit's folder


@dataclass
class FitConfig:
    """Fitting a student (closed form) and choosing its ridge strength on validation."""

    out: str = opt("", "folder for best.safetensors and log.json, written by the CLI (a runs folder by default)")
    corpora: tuple[str, ...] = opt(("austen", "bible", "gcide", "handbook", "jargon", "manpages"),
                                   "shipped corpora: training contexts from their train splits, validation from "
                                   "their calib splits (equally many per corpus)")
    contexts: int = opt(120, "training contexts (each: one prefill + the teacher's continuation)")
    val_contexts: int = opt(24, "validation contexts (calib split) that choose the ridge strength")
    context_len: int = opt(512, "T, tokens per context")
    teacher_len: int = opt(128, "tokens of training text after the context whose attention (the teacher) each "
                           "context token is fitted to")
    decode_len: int = opt(128, "decode states: tokens the model generates greedily (full cache) after each training "
                           "context; the fit also regresses every decode_every-th state of that generation, each "
                           "cached token (context and generated) against the attention the rest of the generation pays "
                           "it, ages as they are then, so the age term is fitted where it acts (0: prefill rows only)")
    decode_every: int = opt(32, "decode states: tokens between the states fitted (and the shortest future scored)")
    decode_weights: tuple[float, ...] = opt((0.1, 0.3, 1.0), "decode states: weights of their rows against the "
                                            "prefill rows' 1, each tried with every ridge strength on validation")
    cont_len: int = opt(24, "validation: continuation tokens scored")
    question_len: int = opt(16, "validation: unscored tokens between context and continuation (bench evict's)")
    keeps: tuple[float, ...] = opt((0.25, 0.125), "validation: kept fractions")
    ridges: tuple[float, ...] = opt((1.0, 10.0, 100.0, 1000.0), "ridge strengths tried (StudentConfig.ridge)")
    val_decode: int = opt(12, "validation while decoding: this many validation contexts (evenly spaced through "
                          "them, so each corpus has its share) also decode val_decode_tokens greedy tokens with "
                          "the cache held at the first kept fraction; the ridge "
                          "is then chosen on the sum of the prefill and decode KLs, each over H2O's on the same "
                          "contexts (0: prefill KL alone)")
    val_decode_tokens: int = opt(128, "validation while decoding: tokens generated (the full cache's greedy choice, "
                                 "teacher-forced as bench evict --decode-tokens does)")
    decode_interval: int = opt(8, "validation while decoding: tokens between cuts (bench evict's decode_interval)")
    listwise: tuple[float, ...] = opt((1e-3,), "then the listwise stage (future teacher): from the chosen closed "
                                      "form, the weights minimising the cross-entropy between the teacher's "
                                      "attention, normalised over each context (and decode state), and the softmax "
                                      "of the scores, plus this L2 penalty on the H_in weights (L-BFGS, per layer); "
                                      "each penalty validated like a ridge strength, the closed form kept when none "
                                      "beats it; empty: none")
    listwise_iters: int = opt(40, "listwise stage: L-BFGS iterations per layer")
    student: StudentConfig = field(default_factory=StudentConfig)


def teacher_score(future: Tensor, per_head: bool) -> Tensor:
    """(R, T) one layer's teacher score: its future attention (Hkv, T); a per-layer student's is the heads' mean."""
    y = future.float()
    return y if per_head else y.mean(0, keepdim=True)


def teacher_rows(future: Tensor, per_head: bool) -> Tensor:
    """(R, T) the regression target of one layer: log of ``teacher_score``, centred per row."""
    y = (teacher_score(future, per_head) + 1e-7).log()
    return y - y.mean(-1, keepdim=True)


def teacher_distribution(future: Tensor, per_head: bool) -> Tensor:
    """(R, T) the listwise stage's target: ``teacher_score`` normalised to sum to 1 per row."""
    y = teacher_score(future, per_head)
    return y / y.sum(-1, keepdim=True).clamp_min(1e-12)


def design_parts(student: Student, hidden: Tensor, values: Tensor, positions: Tensor, now: int,
                 column: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One layer's regression rows in two parts: H_in (T, d), shared by the rows, and the extra columns
    (R, T, 4 or 5): [log ||v||, log(1 + pos), log(now - pos), (log window attention,) 1]; hidden (T, d),
    values (Hkv, T, D), positions (T,), column (Hkv, T) the window's attention (a student with a window)."""
    logv = student.log_norm(values.unsqueeze(0))[0]  # (R, T)
    rows, t = logv.shape
    pos = positions.float()
    cols = [logv, pos.log1p().expand(rows, t), (now - pos).clamp_min(1.0).log().expand(rows, t)]
    if student.config.window:
        if column is None:
            raise ValueError("a student with a window needs the window's attention column")
        c = column.float() if student.config.per_head else column.float().mean(0, keepdim=True)
        cols.append((c + WINDOW_EPS).log().expand(rows, t))
    extra = torch.stack([*cols, torch.ones(rows, t, device=logv.device)], -1)
    return hidden.float(), extra


def design(student: Student, hidden: Tensor, values: Tensor, positions: Tensor, now: int,
           column: Tensor | None = None) -> Tensor:
    """(R, T, F) regression rows of one layer: [H_in, log ||v||, log(1 + pos), log(now - pos), (log window,) 1]."""
    h, extra = design_parts(student, hidden, values, positions, now, column)
    return torch.cat([h.unsqueeze(0).expand(extra.shape[0], -1, -1), extra], -1)


def prefill_column(model, student: Student, layer: int, hidden: Tensor, keys: Tensor) -> Tensor | None:
    """(B, Hkv, T) the window column of a prefill from position 0 (the attention its last W queries pay each of
    its T tokens; ``hf.window_rows``, as StudentPress computes it under SDPA), or None without a window:
    hidden (B, T, d) the layer's inputs, keys (B, Hkv, T, D)."""
    w = min(student.config.window, hidden.shape[1])
    if not w:
        return None
    return window_column(hf.window_rows_at(model, layer, hidden[:, -w:], keys), keys.shape[1])


def prefill_scores(model, student: Student, obs) -> list[Tensor]:
    """Per layer the student's scores (B, Hkv, T) of an observed prefill (``obs.hidden``, ``obs.values``,
    ``obs.keys``), with its window column when it has one."""
    return [student(layer, h, v, column=prefill_column(model, student, layer, h, k))
            for layer, (h, k, v) in enumerate(zip(obs.hidden, obs.keys, obs.values, strict=True))]


class NormalEquations:
    """Accumulated normal equations per layer and row (R rows: the KV heads, or 1 for a per-layer student), float64:
    X'X and X'y of the design rows [H_in (d columns), the extra columns (k)]; ``decode``, when decode states were
    fitted, theirs, kept apart so that ``solve`` can weigh them.

    X'X in one of two layouts. Dense: ``xtx`` (L, R, F, F), as given to the constructor (any matrices). Shared
    (``zeros(..., hidden=d)``, what ``accumulate`` builds): the rows of a layer share its H_in columns, so the
    (d, d) block H_in'H_in, nearly all of X'X, is kept once per layer (``hh``) beside each row's H_in'E (``he``,
    (R, d, k)) and E'E (``ee``, (R, k, k)): R times less memory (Mistral-7B shapes: 134 MB a layer instead of 1.08
    GB) and the same numbers. Either way ``solve`` builds one row's (F, F) matrix at a time (``matrix``), never
    the (L, R, F, F) block; ``xtx`` assembles that block for a shared layout (tests and small models only)."""

    def __init__(self, xtx: Tensor | None, xty: Tensor, rows: int = 0, decode: NormalEquations | None = None, *,
                 hh: list[Tensor] | None = None, he: list[Tensor] | None = None, ee: list[Tensor] | None = None):
        if (xtx is None) == (hh is None) or (hh is None) != (he is None) or (he is None) != (ee is None):
            raise ValueError("give either the dense X'X (L, R, F, F) or its shared blocks hh, he and ee")
        self.dense, self.xty, self.rows, self.decode = xtx, xty, rows, decode
        self.hh, self.he, self.ee = hh, he, ee
        self.seconds_before = 0.0  # seconds spent accumulating them in earlier sittings (a resumed fit's)
        self.resumed_at: list[int] = []  # the training contexts already in them at each resumption

    @classmethod
    def zeros(cls, n_layers: int, rows: int, f: int, hidden: int | None = None) -> NormalEquations:
        """Empty normal equations: in the shared layout when ``hidden`` (d, the H_in columns) is given, per layer
        one (d, d), one (R, d, k) and one (R, k, k) block (k = f - d); dense (L, R, F, F) without it."""
        xty = torch.zeros(n_layers, rows, f, dtype=torch.float64)
        if hidden is None:
            return cls(torch.zeros(n_layers, rows, f, f, dtype=torch.float64), xty)
        k = f - hidden
        return cls(None, xty, hh=[torch.zeros(hidden, hidden, dtype=torch.float64) for _ in range(n_layers)],
                   he=[torch.zeros(rows, hidden, k, dtype=torch.float64) for _ in range(n_layers)],
                   ee=[torch.zeros(rows, k, k, dtype=torch.float64) for _ in range(n_layers)])

    @property
    def xtx(self) -> Tensor:
        """(L, R, F, F) X'X: the dense layout's tensor, or the shared layout's blocks assembled into it (R times
        their memory: for tests and small models; ``solve`` never builds it)."""
        if self.dense is not None:
            return self.dense
        n_layers, rows, _ = self.xty.shape
        return torch.stack([torch.stack([self.matrix(layer, row) for row in range(rows)])
                            for layer in range(n_layers)])

    def _named(self) -> dict[str, Tensor]:
        """Every accumulated tensor by its name in a checkpoint (the decode states' under ``decode.``), the
        tensors themselves."""
        out = {"xty": self.xty}
        if self.dense is not None:
            out["xtx"] = self.dense
        else:
            for layer, blocks in enumerate(zip(self.hh, self.he, self.ee, strict=True)):
                out |= {f"{name}.{layer}": t for name, t in zip(("hh", "he", "ee"), blocks, strict=True)}
        if self.decode is not None:
            out |= {f"decode.{name}": t for name, t in self.decode._named().items()}
        return out

    def tensors(self) -> dict[str, Tensor]:
        """Every accumulated tensor by name, on the host and contiguous: what a checkpoint stores (``load``
        reads them back). Host tensors are not copied."""
        return {name: t.detach().cpu().contiguous() for name, t in self._named().items()}

    def load(self, get) -> None:
        """Set every accumulated tensor, in place, to ``get(name)`` (names as ``tensors``: a checkpoint's
        ``safe_open`` handle's ``get_tensor``), one tensor at a time; ValueError when one differs in shape or
        type (the row counts are the caller's)."""
        for name, t in self._named().items():
            got = get(name)
            if got.shape != t.shape or got.dtype != t.dtype:
                raise ValueError(f"the checkpoint's {name} is {got.dtype} {tuple(got.shape)}, not {t.dtype} "
                                 f"{tuple(t.shape)}")
            t.copy_(got)

    def nbytes(self) -> int:
        """Bytes of the accumulated tensors, the decode states' included."""
        held = [self.xty] + ([self.dense] if self.dense is not None else [*self.hh, *self.he, *self.ee])
        return sum(t.nbytes for t in held) + (self.decode.nbytes() if self.decode is not None else 0)

    def matrix(self, layer: int, row: int) -> Tensor:
        """(F, F) X'X of one row of one layer, a new tensor."""
        if self.dense is not None:
            return self.dense[layer, row].clone()
        hh, he, ee = self.hh[layer], self.he[layer][row], self.ee[layer][row]
        d, f = hh.shape[0], self.xty.shape[-1]
        out = torch.empty(f, f, dtype=torch.float64, device=hh.device)
        out[:d, :d] = hh
        out[:d, d:] = he
        out[d:, :d] = he.T
        out[d:, d:] = ee
        return out

    def add(self, layer: int, hidden: Tensor, extra: Tensor, y: Tensor) -> None:
        """Add one context's rows (``design_parts``) and targets y (R, T), block by block: H_in'H_in once
        for all rows (float32 per context, summed in float64)."""
        h, e, y = hidden.float().cpu(), extra.float().cpu(), y.float().cpu()
        d = h.shape[1]
        cross = torch.einsum("td,rtk->rdk", h, e).double()
        if self.dense is not None:
            xtx = self.dense[layer]
            xtx[:, :d, :d] += (h.T @ h).double()
            xtx[:, :d, d:] += cross
            xtx[:, d:, :d] += cross.transpose(1, 2)
            xtx[:, d:, d:] += (e.transpose(1, 2) @ e).double()
        else:  # the same sums, H_in'H_in once (promoted to float64 in the add, as .double() would)
            self.hh[layer] += h.T @ h
            self.he[layer] += cross
            self.ee[layer] += (e.transpose(1, 2) @ e).double()
        xty = self.xty[layer]
        xty[:, :d] += (y @ h).double()
        xty[:, d:] += torch.einsum("rtk,rt->rk", e, y).double()

    def solve(self, ridge: float, decode_weight: float = 1.0) -> Tensor:
        """(L, R, F) the ridge solution; the intercept (last column) is not shrunk; ridge relative to 1e-3 x the
        mean diagonal. ``decode_weight``: the weight of the decode states' rows (``decode``) against the prefill
        rows'. One row of one layer at a time: its (F, F) matrix built (``matrix``), the decode states' added and
        the ridge put on its diagonal in place, then factored; the numbers are those of the (L, R, F, F) batch
        the same operations make."""
        n_layers, rows, f = self.xty.shape
        out = torch.empty(n_layers, rows, f, dtype=torch.float32, device=self.xty.device)
        for layer in range(n_layers):
            for row in range(rows):
                a, b = self.matrix(layer, row), self.xty[layer, row]
                if self.decode is not None:
                    weighted = self.decode.matrix(layer, row)
                    weighted *= decode_weight
                    a += weighted
                    del weighted
                    b = b + decode_weight * self.decode.xty[layer, row]
                diagonal = a.diagonal()
                diagonal[:-1] += ridge * 1e-3 * diagonal.mean()
                # Cholesky, not LU: the matrices are symmetric positive definite, and torch's batched LU solve
                # failed on CPU with 2 threads at this size ("Pivots given to lu_solve...", torch 2.13 with MKL)
                factor = torch.linalg.cholesky(a)
                del a, diagonal
                out[layer, row] = torch.cholesky_solve(b.unsqueeze(-1), factor)[:, 0]
        return out


class Lists:
    """The listwise stage's data, spooled to ``folder`` one training context at a time (at Mistral-7B shapes about
    5.4 MB per layer and context: 20.8 GB on the shipped recipe's 120 contexts, which host memory would otherwise
    hold) and read back one layer at a time (``layer``). Per layer and context: the layer's inputs (rows, d) in
    float16 (the context's, then its generation's up to the last decode state), and per scored list (the prefill,
    or a decode state of ``now`` tokens, keyed by ``now``) the extra columns (R, now, k) and the teacher's
    distribution (R, now). ``set_hidden`` / ``add`` fill the current context, ``flush`` writes it
    (``context-NNNNN.safetensors``) and starts the next; ``resume`` continues a spool a stopped fit left. ``fit``
    spools into its folder (``SPOOL``), beside its checkpoint, so a resumed fit's stage sees every context."""

    def __init__(self, folder, n_layers: int):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.n_layers, self.contexts = n_layers, 0
        self._current: dict[str, Tensor] = {}

    def resume(self, contexts: int) -> None:
        """Continue a spool that already holds its first ``contexts`` contexts (a resumed fit's; those after them,
        left by a sitting that stopped before its next checkpoint, are written again); ValueError when one of them
        is missing."""
        missing = [n for n in range(contexts) if not (self.folder / f"context-{n:05d}.safetensors").is_file()]
        if missing:
            raise ValueError(f"the listwise spool {self.folder} lacks context {missing[0]} of the {contexts} its "
                             "checkpoint counts: remove the folder's checkpoint to start the fit again")
        self.contexts, self._current = contexts, {}

    def set_hidden(self, layer: int, hidden: Tensor) -> None:
        """The current context's inputs of ``layer`` (rows, d), replacing the ones set before (a decode state's rows
        extend the context's)."""
        self._current[f"{layer}.hidden"] = hidden.half().cpu().contiguous()

    def add(self, layer: int, extra: Tensor, target: Tensor) -> None:
        """One list of ``layer`` in the current context: extra (R, now, k), target (R, now)."""
        now = extra.shape[1]
        self._current[f"{layer}.extra.{now}"] = extra.float().cpu().contiguous()
        self._current[f"{layer}.target.{now}"] = target.float().cpu().contiguous()

    def flush(self) -> None:
        """Write the current context to the spool and start the next (nothing set: nothing written)."""
        if self._current:
            save_file(self._current, str(self.folder / f"context-{self.contexts:05d}.safetensors"))
            self.contexts += 1
            self._current = {}

    def layer(self, layer: int) -> tuple[Tensor, dict[int, tuple[Tensor, Tensor]]]:
        """One layer's data over the spooled contexts: the inputs (N, rows, d) in float32 and per list length
        ``now`` its extra columns (N, R, now, k) and targets (N, R, now); only this layer's tensors are read."""
        hidden, extra, target = [], {}, {}
        for n in range(self.contexts):
            with safe_open(str(self.folder / f"context-{n:05d}.safetensors"), "pt") as fh:
                for key in fh.keys():
                    head, kind, *now = key.split(".")
                    if int(head) != layer:
                        continue
                    if kind == "hidden":
                        hidden.append(fh.get_tensor(key))
                    else:
                        (extra if kind == "extra" else target).setdefault(int(now[0]), []).append(fh.get_tensor(key))
        if not hidden:
            raise ValueError(f"the listwise spool {self.folder} holds no context of layer {layer}")
        h = torch.stack(hidden).float()
        del hidden
        return h, {now: (torch.stack(extra[now]), torch.stack(target[now])) for now in sorted(extra)}


def listwise_layer(lists: Lists, layer: int, start: Tensor, penalty: float, decode_weight: float, iters: int
                   ) -> Tensor:
    """(R, F) one layer's listwise weights: from ``start`` (R, F), L-BFGS on the mean over lists of
    CE(teacher || softmax(scores)), the decode states' lists weighted ``decode_weight`` against the prefill's 1,
    plus ``penalty`` x the mean over rows of ||w_H||^2."""
    h, by_now = lists.layer(layer)  # (N, rows, d), per list length its (extra, target)
    d = h.shape[-1]
    prefill = min(by_now)
    groups = [(n, extra, target, 1.0 if n == prefill else decode_weight) for n, (extra, target) in by_now.items()]
    total = sum(c for *_, c in groups)
    w = start.float().clone().requires_grad_(True)
    opt = torch.optim.LBFGS([w], lr=1, max_iter=iters, line_search_fn="strong_wolfe", history_size=20)

    def closure():
        opt.zero_grad()
        base = torch.einsum("ntd,rd->nrt", h, w[:, :d])  # (N, R, rows)
        loss = penalty * (w[:, :d] ** 2).sum(-1).mean()
        for n, extra, target, c in groups:
            scores = base[..., :n] + (extra * w[None, :, None, d:]).sum(-1)
            loss = loss - c / total * (target * torch.log_softmax(scores, -1)).sum(-1).mean()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def windows(tokenizer, cfg: FitConfig, split: str, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens, equally many from each corpus's ``split``, drawn evenly through it (as
    the benchmark's eval contexts are: the train and calib splits interleave passages of one text, so their first
    windows come from neighbouring parts of it)."""
    per = -(-count // len(cfg.corpora))
    out = []
    for c in cfg.corpora:
        out += data.token_windows(tokenizer, data.passages(c, split), length, per, spread=True)
    if len(out) < count:
        raise ValueError(f"only {len(out)} {split} windows of {length} tokens in {', '.join(cfg.corpora)}")
    return out[:count]


def accumulate(model, tokenizer, cfg: FitConfig, student: Student, progress: bool | Reporter = True,
               lists: Lists | None = None, folder: str | Path | None = None, key: dict | None = None
               ) -> NormalEquations:
    """The normal equations over ``cfg.contexts`` training contexts: per context an SDPA prefill (H_in and
    values of every layer) and the teacher's continuation over the full cache with eager attention; with
    ``lists``, the listwise stage's data is collected there too.

    With ``folder``, they are checkpointed there (``_save_checkpoint``) every ``CHECKPOINT_EVERY`` contexts or
    ``CHECKPOINT_S`` seconds, whichever comes first, when all are in, and when stopped (the reporter raises
    ``Stopped``) or failing between two contexts (a failure or Ctrl-C inside a context leaves the checkpoint before
    it, since the sums in memory then hold part of that context); a checkpoint there of the same ``key`` (default
    ``_checkpoint_key``) is resumed: its sums loaded, only the contexts after it accumulated, ``lists`` continued
    (``Lists.resume``). ValueError, before any work, for a checkpoint of another fit."""
    t0 = time.perf_counter()
    n_layers, rows, f = student.weight.shape
    normal = NormalEquations.zeros(n_layers, rows, f, hidden=student.hidden)  # H_in'H_in once per layer
    if cfg.decode_len:
        normal.decode = NormalEquations.zeros(n_layers, rows, f, hidden=student.hidden)
    done = saved = 0
    last = t0  # when the last checkpoint was written (or the fit began)
    if folder is not None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        key = _checkpoint_key(cfg, model, lists is not None) if key is None else key
        resumed = _load_checkpoint(folder, key, normal)
        if resumed is not None:
            done = saved = resumed
            normal.resumed_at.append(done)
            if lists is not None:
                lists.resume(done)

    def save() -> None:
        nonlocal saved, last
        _save_checkpoint(folder, key, done, normal, normal.seconds_before + time.perf_counter() - t0)
        saved, last = done, time.perf_counter()

    todo = windows(tokenizer, cfg, "train", cfg.contexts, cfg.context_len + cfg.teacher_len)[done:]
    desc = "student: prefill and teacher (train contexts" + (f"; resumed after {done})" if done else ")")
    between = True  # the sums hold whole contexts only: a checkpoint now is one of ``done`` contexts
    try:
        for window in steps(todo, desc, progress):
            between = False
            _add_context(model, cfg, student, normal, window, lists)
            done, between = done + 1, True
            if folder is not None and (not done % CHECKPOINT_EVERY or time.perf_counter() - last > CHECKPOINT_S):
                save()
    except BaseException:  # stopped or killed: the contexts done are kept, and the same call resumes after them
        if folder is not None and between and done != saved:
            save()
        raise
    if folder is not None and done != saved:
        save()
    return normal


def _add_context(model, cfg: FitConfig, student: Student, normal: NormalEquations, window: list[int],
                 lists: Lists | None) -> None:
    """One training context's rows (``window``: its ``cfg.context_len`` tokens, then the teacher's), its decode
    states' too, added to ``normal`` (and ``lists``, then flushed)."""
    n_layers, t, n_kv = student.weight.shape[0], cfg.context_len, hf.attn_heads(model)[1]
    ids = hf.ids_tensor(window, device=hf.device_of(model))
    with torch.no_grad():
        trace = hf.forward(model, ids[:, :t], capture={"h_in"}, last_logits=True)
        with hf.eager(model):
            cont = hf.forward(model, ids[:, t:], cache=hf.make_cache(model, trace.keys, trace.values),
                              attentions=True, last_logits=True)
    future = F.future_attention(cont.attn, t, n_kv)[0][:, 0]  # (L, Hkv, T)
    positions = torch.arange(t, device=ids.device)
    for layer in range(n_layers):
        column = prefill_column(model, student, layer, trace.h_in[layer], trace.keys[layer])
        h, extra = design_parts(student, trace.h_in[layer][0], trace.values[layer][0], positions, t,
                                None if column is None else column[0])
        normal.add(layer, h, extra, teacher_rows(future[layer], student.config.per_head))
        if lists is not None:
            lists.set_hidden(layer, h)
            lists.add(layer, extra, teacher_distribution(future[layer], student.config.per_head))
    normal.rows += t
    if cfg.decode_len:
        _add_decode_states(model, cfg, student, normal.decode, ids[:, t : t + 1], trace, lists)
    if lists is not None:
        lists.flush()


SUMMED = ("corpora", "contexts", "context_len", "teacher_len", "decode_len", "decode_every")  # what the sums depend on


def _checkpoint_key(cfg: FitConfig, model, listwise: bool) -> dict:
    """What a checkpoint must match to be resumed: the model (``artefact.fingerprint``) and the settings the
    checkpointed sums and listwise spool depend on (``SUMMED``; ``listwise``, whether the listwise stage's lists
    were collected beside them; the student's shape: all of ``StudentConfig`` but the ridge). Where the student is
    written and everything chosen after the sums (validation, ridges, decode weights, listwise penalties and
    iterations) may change between sittings. As JSON reads it back (tuples as lists)."""
    recipe = {k: v for k, v in config.to_dict(cfg).items() if k in SUMMED}
    recipe["listwise"] = listwise
    recipe["student"] = {k: v for k, v in config.to_dict(cfg.student).items() if k != "ridge"}
    return json.loads(json.dumps({"model": artefact.fingerprint(model), "config": recipe}))


def _key_difference(theirs: dict, ours: dict) -> str:
    """What differs between two checkpoint keys, in words: the model, or each setting as ``name: A there, B
    here`` (nested ones dotted)."""
    if theirs.get("model") != ours.get("model"):
        return f"another model: fingerprint {theirs.get('model')} there, {ours.get('model')} here"

    def flat(d: dict, at: str = "") -> dict:
        return {k: v for name, value in d.items()
                for k, v in (flat(value, f"{at}{name}.").items() if isinstance(value, dict)
                             else [(f"{at}{name}", value)])}

    a, b = flat(theirs.get("config", {})), flat(ours.get("config", {}))
    return "; ".join(f"{name}: {a.get(name, '(none)')} there, {b.get(name, '(none)')} here"
                     for name in sorted(a.keys() | b.keys()) if a.get(name) != b.get(name))


def _save_checkpoint(folder: Path, key: dict, done: int, normal: NormalEquations, seconds: float) -> None:
    """The sums of the first ``done`` training contexts, whole (written, then renamed): their tensors
    (``NormalEquations.tensors``, float64) and, in the tensors' own metadata and in ``checkpoint.json``, ``done``
    and the row counts; the JSON also holds ``key`` and the seconds spent accumulating, every sitting's."""
    counters = {"done": done, "rows": normal.rows, "decode_rows": normal.decode.rows if normal.decode else 0}
    save_file(normal.tensors(), str(folder / "checkpoint.part"), metadata={k: str(v) for k, v in counters.items()})
    state = {"key": key, **counters, "seconds": round(seconds, 1), "resumed_at": normal.resumed_at}
    (folder / "checkpoint.json.part").write_text(json.dumps(state))
    os.replace(folder / "checkpoint.part", folder / "checkpoint.safetensors")
    os.replace(folder / "checkpoint.json.part", folder / "checkpoint.json")


def _load_checkpoint(folder: Path, key: dict, normal: NormalEquations) -> int | None:
    """The training contexts done by the checkpoint in ``folder``, with ``normal`` set to its sums (row counts,
    earlier sittings' seconds and resumptions too); None when there is none. ValueError for one of another fit,
    naming what differs. The counters are the tensors' own (their metadata): a sitting killed between renaming
    the tensors and the JSON leaves a JSON one checkpoint older, never sums counted twice."""
    if not (folder / "checkpoint.json").exists():
        return None
    state = json.loads((folder / "checkpoint.json").read_text())
    if state["key"] != key:
        raise ValueError(f"{folder} holds the checkpoint of another fit ({_key_difference(state['key'], key)}); "
                         "give another folder, or remove that one to start again")
    with safe_open(str(folder / "checkpoint.safetensors"), "pt") as fh:
        counters = {k: int(v) for k, v in fh.metadata().items()}
        normal.load(fh.get_tensor)
    normal.rows = counters["rows"]
    if normal.decode is not None:
        normal.decode.rows = counters["decode_rows"]
    normal.seconds_before = float(state["seconds"])
    normal.resumed_at = list(state.get("resumed_at", []))
    return counters["done"]


def remove_checkpoint(folder: str | Path) -> None:
    """Remove what ``fit`` wrote into ``folder`` (its checkpoint and listwise spool), and the folder when nothing
    else is left in it: once the fit's student is saved, nothing in there is needed."""
    folder = Path(folder)
    for name in CHECKPOINT_FILES:
        (folder / name).unlink(missing_ok=True)
    shutil.rmtree(folder / SPOOL, ignore_errors=True)
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def _add_decode_states(model, cfg: FitConfig, student: Student, normal: NormalEquations, first, trace,
                       lists: Lists | None = None) -> None:
    """Rows of one context's decode states: the model generates ``cfg.decode_len`` tokens greedily after the
    prefill ``trace`` (full cache, ``first`` the next token); at every ``decode_every``-th of them each cached token
    (context and generated) is regressed on the attention the rest of the generation pays it, at its age then."""
    t, n_kv = trace.keys[0].shape[2], hf.attn_heads(model)[1]
    steps_ids = _greedy_steps(model, trace.keys, trace.values, first, cfg.decode_len)
    with torch.no_grad(), hf.eager(model):
        dec = hf.forward(model, steps_ids, cache=hf.make_cache(model, trace.keys, trace.values), capture={"h_in"},
                         attentions=True, last_logits=True)
    values = hf.cache_kv(dec.cache)[1]
    w = student.config.window
    for s in range(cfg.decode_every, steps_ids.shape[1], cfg.decode_every):
        now = t + s
        future = F.future_attention([a[..., s:, :now] for a in dec.attn], now, n_kv)[0][:, 0]  # (L, Hkv, now)
        positions = torch.arange(now, device=first.device)
        for layer in range(len(values)):
            hidden = torch.cat([trace.h_in[layer][0], dec.h_in[layer][0, :s]], 0)
            # the window: the attention rows of the last W generated tokens (fewer when s < W), as DecodeEvictor
            # buffers them while decoding
            column = window_column(dec.attn[layer][:, :, max(0, s - w) : s, :now], n_kv)[0] if w else None
            h, extra = design_parts(student, hidden, values[layer][0, :, :now], positions, now, column)
            normal.add(layer, h, extra, teacher_rows(future[layer], student.config.per_head))
            if lists is not None:  # the context's hidden rows grow to this state's
                lists.set_hidden(layer, h)
                lists.add(layer, extra, teacher_distribution(future[layer], student.config.per_head))
        normal.rows += now


def _greedy_steps(model, keys, values, first: Tensor, tokens: int) -> Tensor:
    """(1, tokens) the inputs of a full-cache greedy generation after a prefill's ``keys`` / ``values``:
    ``first`` (the next token), then the generated tokens but the last."""
    gen = hf.generate(model, hf.make_cache(model, keys, values), first, keys[0].shape[2], tokens)
    return torch.cat([first, hf.ids_tensor(gen[:-1], device=first.device)], 1)


def decoded_subset(val: list, count: int) -> list:
    """The ``count`` validation samples that also decode: evenly spaced through ``val`` (laid out corpus by
    corpus), so every corpus has its share."""
    if count <= 0 or not val:
        return []
    return [val[int(i * len(val) / min(count, len(val)))] for i in range(min(count, len(val)))]


def decode_episodes(model, samples: list, tokens: int) -> list[trainer.Sample]:
    """Each sample with its tail replaced by the full cache's greedy generation of ``tokens`` tokens after its
    context, every one of them scored (bench evict's decode)."""
    out = []
    for sample in samples:
        obs = sample.obs
        steps_ids = _greedy_steps(model, obs.keys, obs.values, sample.cont[:, :1].to(hf.device_of(model)), tokens)
        ref = hf.continue_logits(model, hf.make_cache(model, obs.keys, obs.values), steps_ids, obs.n_tokens)[0]
        out.append(dataclasses.replace(sample, cont=steps_ids, ref=ref))
    return out


def decode_kls(model, episodes: list[trainer.Sample], keep: float, interval: int, student: Student | None = None
               ) -> list[float]:
    """Per episode, the mean per-step KL(full || held) while decoding its tokens with every layer's cache held at
    ``keep`` of the context by ``student`` (its top-B at prefill, then DecodeEvictor from the kept tokens' arrival
    scores), or, without a student, by H2O (its prefill score, then kvpress's ObservedAttentionPress over the
    decode window), cutting every ``interval`` tokens as bench evict does."""
    out = []
    with torch.no_grad():
        for ep in episodes:
            obs = ep.obs
            n_keep = keep_count(obs.n_tokens, keep)
            if student is None:
                scores, press, per_layer = trainer.rows_of_feature(obs, True, 0), ObservedAttentionPress(), None
            else:
                scores = torch.cat([s[0] for s in prefill_scores(model, student, obs)], 0)
                per_layer = [student.static(layer, h, v, torch.arange(obs.n_tokens, device=h.device))
                             for layer, (h, v) in enumerate(zip(obs.hidden, obs.values, strict=True))]
                press = StudentPress(student=student)
            idx = trainer.indices_from_rows(scores.topk(n_keep, dim=-1).indices, obs, True)
            evictor = DecodeEvictor(press, budget=n_keep, window=DECODE_WINDOW, interval=interval,
                                    prefill_positions=list(idx), prefill_scores=per_layer)
            out.append(float(trainer.held_kl(model, ep, idx, evictor).mean()))
    return out


def prepared_samples(model, tokenizer, cfg: FitConfig, split: str, count: int, progress: bool | Reporter) -> list:
    """``count`` contexts of ``split`` prefilled as ``train.prepare`` does (each layer's input kept), on this
    fit's windows; the features see every row (H2O's score, the heuristic line)."""
    tcfg = trainer.TrainConfig(out="unused", corpora=tuple(cfg.corpora), context_len=cfg.context_len,
                               cont_len=cfg.cont_len, question_len=cfg.question_len, keeps=tuple(cfg.keeps))
    tcfg.policy.window = cfg.context_len
    length = cfg.context_len + cfg.question_len + cfg.cont_len
    return trainer.prepare(model, tokenizer, tcfg, split, count, progress, hidden=True,
                           windows=windows(tokenizer, cfg, split, count, length))


def fit(cfg: FitConfig, subject, progress: bool | Reporter = True, folder: str | Path | None = None) -> Student:
    """Fit a student for ``subject`` (a Pair, whose producer is pruned, or (model, tokenizer, source)); returns
    it with ``log``: every ridge's (and listwise penalty's) validation KL (mean and per kept fraction), H2O's on
    the same contexts, the chosen ridge and the seconds taken (every sitting's accumulation, and this sitting);
    ``stages["closed_form"]`` is the ridge fit alone.

    ``folder`` holds the fit's checkpoint (the closed form's sums: ``accumulate``) and the listwise stage's spool
    (``SPOOL``): a fit stopped or killed and called again with the same ``folder`` and config resumes after the
    last context checkpointed and ends with the same student as one never interrupted; ValueError, before any
    work, for a folder holding another fit's checkpoint. The folder is left as it is when the fit ends
    (``remove_checkpoint`` clears it). Without one, a temporary folder (inside ``cfg.out`` when set, else the
    system's), deleted when the fit ends, however it ends."""
    model, tokenizer, source = trainer.subject(subject)
    compressed_layers(model)  # a model of sliding-window layers only has nothing to compress: refused before any work
    if folder is not None:
        return _fit(cfg, model, tokenizer, source, Path(folder), progress)
    if cfg.out:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="scdviz-fit-", dir=cfg.out or None) as tmp:
        return _fit(cfg, model, tokenizer, source, Path(tmp), progress)


def _fit(cfg: FitConfig, model, tokenizer, source: str, folder: Path, progress: bool | Reporter) -> Student:
    """``fit`` into ``folder`` once the model is checked."""
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    base = Student.for_model(model, cfg.student)
    # the listwise stage's lists on disk, not in host memory, beside the checkpoint: a resumed fit has them all
    lists = Lists(folder / SPOOL, hf.n_layers(model)) if cfg.listwise else None
    normal = accumulate(model, tokenizer, cfg, base, progress, lists, folder)
    decoding = bool(normal.decode)
    val = prepared_samples(model, tokenizer, cfg, "calib", cfg.val_contexts, progress)
    # windows are always spread through their splits: the log says so, as a policy's does (bench.LoadedPolicy reads it)
    log = {"config": {**config.to_dict(cfg), "spread": True}, "val": [], "rows": normal.rows,
           "decode_rows": normal.decode.rows if normal.decode else 0}
    if normal.resumed_at:
        log["resumed_at"] = list(normal.resumed_at)

    def scorer(student: Student):
        return lambda s: torch.cat([p[0] for p in prefill_scores(model, student, s.obs)], 0)

    h2o = trainer.validation_kls(model, lambda s: trainer.rows_of_feature(s.obs, True, 0), True, val, cfg.keeps)
    log["val_heuristic"] = round(sum(h2o) / len(h2o), 5)
    episodes = decode_episodes(model, decoded_subset(val, cfg.val_decode), cfg.val_decode_tokens)
    if episodes:
        h2o_decode = decode_kls(model, episodes, cfg.keeps[0], cfg.decode_interval)
        log["val_decode_heuristic"] = round(sum(h2o_decode) / len(h2o_decode), 5)
        log["h2o_decode_per_context"] = [round(v, 6) for v in h2o_decode]
    best, best_kl, best_choice, best_weight, best_decode = None, math.inf, math.inf, None, None
    closed, closed_kl, closed_weight, closed_decode = best, best_kl, best_weight, best_decode  # the ridge pick
    weights = cfg.decode_weights if normal.decode else (1.0,)
    candidates = [(r, w, None) for r in cfg.ridges for w in weights] + [(None, None, p) for p in
                                                                         (cfg.listwise if lists else ())]
    for ridge, weight, penalty in steps(candidates, "student: ridge strengths (and decode-state weights), then the "
                                        "listwise stage, on validation", progress):
        if penalty is None:
            student = Student.for_model(model, dataclasses.replace(cfg.student, ridge=float(ridge)))
            with torch.no_grad():
                student.weight.copy_(normal.solve(float(ridge), float(weight)))
        else:  # the listwise stage, from the closed form chosen so far
            ridge, weight = closed.config.ridge, closed_weight
            student = Student.for_model(model, closed.config)
            with torch.no_grad():
                student.weight.copy_(torch.stack([
                    listwise_layer(lists, layer, closed.weight[layer].detach(), float(penalty),
                                   float(weight if normal.decode else 1.0), cfg.listwise_iters)
                    for layer in range(student.weight.shape[0])]))
        kls = trainer.validation_kls(model, scorer(student), True, val, cfg.keeps)
        mean = sum(kls) / len(kls)
        by_keep = {f"{k:g}": round(sum(kls[i::len(cfg.keeps)]) / len(kls[i::len(cfg.keeps)]), 5)
                   for i, k in enumerate(cfg.keeps)}
        entry = {"ridge": float(ridge), "kl": round(mean, 5), "kl_by_keep": by_keep,
                 "kl_per_context": [round(v, 6) for v in kls]} | ({"decode_weight": weight} if decoding else {}) \
            | ({} if penalty is None else {"listwise_penalty": float(penalty)})
        choice = mean
        if episodes:  # the same student held while decoding; each KL over H2O's on the same contexts
            dec = decode_kls(model, episodes, cfg.keeps[0], cfg.decode_interval, student)
            entry |= {"decode_kl": round(sum(dec) / len(dec), 5), "decode_kl_per_context": [round(v, 6) for v in dec]}
            choice = mean / max(log["val_heuristic"], 1e-12) + sum(dec) / max(sum(h2o_decode), 1e-12)
        log["val"].append(entry)
        student.meta = {"listwise_penalty": None if penalty is None else float(penalty)}
        if choice < best_choice:
            best, best_kl, best_choice, best_weight, best_decode = student, mean, choice, weight, entry.get("decode_kl")
        if penalty is None:  # the closed form so far
            closed, closed_kl, closed_weight, closed_decode = best, best_kl, best_weight, best_decode
    log["h2o_per_context"] = [round(v, 6) for v in h2o]
    log["closed_form_kl"] = round(closed_kl, 5)
    log["seconds"] = round(normal.seconds_before + time.perf_counter() - t0, 1)  # every sitting's accumulation
    n_heads, _, head_dim = hf.attn_heads(model)
    for one, kl, decoding, weight in ((closed, log["closed_form_kl"], closed_decode, closed_weight),
                                      (best, best_kl, best_decode, best_weight)):
        one.identity = {"model_source": source, "model_fingerprint": artefact.fingerprint(model)}
        one.meta = {"val_kl": round(kl, 5), "val_heuristic": log["val_heuristic"], "ridge": one.config.ridge,
                    "listwise_penalty": one.meta.get("listwise_penalty"),
                    "decode_weight": weight if decoding else None,
                    "val_decode_kl": decoding, "val_decode_heuristic": log.get("val_decode_heuristic"),
                    "train_contexts": cfg.contexts,
                    "flops_per_token_layer": one.flops_per_token(head_dim, n_heads, cfg.context_len)}
        one.log = log
    best.stages = {"closed_form": closed}  # the ridge fit alone (the same student when the listwise stage lost)
    return best.eval()

"""Fitting the DistillCache student (``fit``): closed-form distillation, then REINFORCE on the seed's reward.

``fit`` distils it in closed form: ridge regression (float64 normal equations, accumulated
context by context) of the teacher's log-score, centred per row (top-B within a row does not
see a row's offset). The teacher (training text only): the attention that ``teacher_len`` tokens
of the text that follows each context pay to each context token over the full cache (the
foresight oracle, ``features.future_attention``), optionally mixed with KVzip's reconstruction
score (``recall``: the most attention any query pays each token while the model repeats the
context, ``features.reconstruction_attention``). The ridge strength is chosen on validation
contexts (calib split) by the KL the benches report (``train.validation_kls``: deterministic
top-B, the continuation teacher-forced after ``question_len`` unscored tokens); then
``reinforce`` trains it on the seed's reward from there, the best validated checkpoint kept
(the closed form is step 0). Writes nothing: the CLI saves what it returns (``Student.save``).
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from scdviz import artefact, config, data
from scdviz.config import opt
from scdviz.evict import features as F
from scdviz.evict import train as trainer
from scdviz.evict.policy import gumbel_top_b, keep_count
from scdviz.evict.student import Student, StudentConfig
from scdviz.models import hf
from scdviz.progress import Reporter, steps


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
    teacher_len: int = opt(128, "tokens of training text after the context whose attention is the teacher")
    recall: float = opt(0.0, "weight of the reconstruction teacher (KVzip's score: the most attention any query pays "
                        "each context token while the model repeats the context after a request to) in the target "
                        "log(w x recall + (1 - w) x future), each normalised per row; 0: the future alone")
    cont_len: int = opt(24, "validation: continuation tokens scored")
    question_len: int = opt(16, "validation: unscored tokens between context and continuation (bench evict's)")
    keeps: tuple[float, ...] = opt((0.25, 0.125), "validation: kept fractions")
    ridges: tuple[float, ...] = opt((1.0, 10.0, 100.0, 1000.0), "ridge strengths tried (StudentConfig.ridge)")
    spread: bool = opt(False, "draw each corpus's windows evenly through its split (as the benchmark's eval contexts "
                       "are) instead of its first ones: the train and calib splits interleave passages of one "
                       "text, so their first windows come from neighbouring parts of it")
    rl_steps: int = opt(200, "then REINFORCE steps on the seed's reward (-KL of the continuation for each of "
                        "`samples` Gumbel top-B kept sets, leave-one-out baseline), from the closed form; 0: none "
                        "(per-head students; a per-layer one stays at its closed form)")
    rl_contexts: int = opt(48, "REINFORCE's training contexts (train split; the tail after question_len is scored)")
    samples: int = opt(4, "M, sampled kept sets per REINFORCE step")
    lr: float = opt(1e-4, "Adam learning rate of REINFORCE")
    entropy_coef: float = opt(1e-4, "weight of REINFORCE's entropy bonus")
    checkpoint_every: int = opt(25, "REINFORCE steps between validations; the student kept is the best validated one "
                                "(the closed form counts as step 0)")
    seed: int = opt(0, "REINFORCE's sampling and data order")
    student: StudentConfig = field(default_factory=StudentConfig)


REPEAT = "\n\nRepeat the previous context exactly."  # KVzip's reconstruction request (kvpress)


def teacher_rows(future: Tensor, per_head: bool, recall: Tensor | None = None, weight: float = 0.0) -> Tensor:
    """(R, T) the regression target of one layer: log of its future attention (Hkv, T), or of
    ``weight`` x the reconstruction score + (1 - weight) x that, each normalised per row; centred per row."""
    y = future.float()
    if recall is not None and weight > 0:
        def share(x: Tensor) -> Tensor:
            return x.float() / x.float().sum(-1, keepdim=True).clamp_min(1e-12)
        y = weight * share(recall) + (1 - weight) * share(y)
    y = y if per_head else y.mean(0, keepdim=True)
    y = (y + 1e-7).log()
    return y - y.mean(-1, keepdim=True)


def design_parts(student: Student, hidden: Tensor, values: Tensor, positions: Tensor, now: int
                 ) -> tuple[Tensor, Tensor]:
    """One layer's regression rows in two parts: H_in (T, d), shared by the rows, and the extra columns
    (R, T, 4): [log ||v||, log(1 + pos), log(now - pos), 1]; hidden (T, d), values (Hkv, T, D), positions (T,)."""
    logv = student.log_norm(values.unsqueeze(0))[0]  # (R, T)
    rows, t = logv.shape
    pos = positions.float()
    extra = torch.stack([logv, pos.log1p().expand(rows, t), (now - pos).clamp_min(1.0).log().expand(rows, t),
                         torch.ones(rows, t, device=logv.device)], -1)
    return hidden.float(), extra


def design(student: Student, hidden: Tensor, values: Tensor, positions: Tensor, now: int) -> Tensor:
    """(R, T, d + 4) regression rows of one layer: [H_in, log ||v||, log(1 + pos), log(now - pos), 1]."""
    h, extra = design_parts(student, hidden, values, positions, now)
    return torch.cat([h.unsqueeze(0).expand(extra.shape[0], -1, -1), extra], -1)


@dataclass
class NormalEquations:
    """Accumulated normal equations per layer: X'X (L, R, F, F) and X'y (L, R, F), float64."""

    xtx: Tensor
    xty: Tensor
    rows: int = 0

    def add(self, layer: int, hidden: Tensor, extra: Tensor, y: Tensor) -> None:
        """Add one context's rows (``design_parts``) and targets y (R, T), block by block: H_in'H_in once
        for all rows (float32 per context, summed in float64)."""
        h, e, y = hidden.float().cpu(), extra.float().cpu(), y.float().cpu()
        d = h.shape[1]
        xtx, xty = self.xtx[layer], self.xty[layer]
        xtx[:, :d, :d] += (h.T @ h).double()
        cross = torch.einsum("td,rtk->rdk", h, e).double()
        xtx[:, :d, d:] += cross
        xtx[:, d:, :d] += cross.transpose(1, 2)
        xtx[:, d:, d:] += (e.transpose(1, 2) @ e).double()
        xty[:, :d] += (y @ h).double()
        xty[:, d:] += torch.einsum("rtk,rt->rk", e, y).double()

    def solve(self, ridge: float) -> Tensor:
        """(L, R, F) the ridge solution; the intercept is not shrunk; ridge relative to 1e-3 x the mean diagonal."""
        f = self.xtx.shape[-1]
        eye = torch.eye(f, dtype=torch.float64)
        eye[-1, -1] = 0
        scale = self.xtx.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
        return torch.linalg.solve(self.xtx + ridge * 1e-3 * scale * eye, self.xty.unsqueeze(-1))[..., 0].float()


def windows(tokenizer, cfg: FitConfig, split: str, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens, equally many from each corpus's ``split``."""
    per = -(-count // len(cfg.corpora))
    out = []
    for c in cfg.corpora:
        every = data.token_windows(tokenizer, data.passages(c, split), length, None if cfg.spread else per)
        out += every if len(every) <= per else [every[int((i + 0.5) * len(every) / per)] for i in range(per)]
    if len(out) < count:
        raise ValueError(f"only {len(out)} {split} windows of {length} tokens in {', '.join(cfg.corpora)}")
    return out[:count]


def accumulate(model, tokenizer, cfg: FitConfig, student: Student, progress: bool | Reporter = True) -> NormalEquations:
    """The normal equations over ``cfg.contexts`` training contexts: per context an SDPA prefill (H_in and
    values of every layer) and the teacher's continuation over the full cache with eager attention."""
    n_layers, rows, f = student.weight.shape
    normal = NormalEquations(torch.zeros(n_layers, rows, f, f, dtype=torch.float64),
                     torch.zeros(n_layers, rows, f, dtype=torch.float64))
    t = cfg.context_len
    positions = torch.arange(t)
    _, n_kv, _ = hf.attn_heads(model)
    repeat = tokenizer(REPEAT, add_special_tokens=False)["input_ids"] if cfg.recall else []
    for window in steps(windows(tokenizer, cfg, "train", cfg.contexts, t + cfg.teacher_len),
                        "student: prefill and teacher (train contexts)", progress):
        ids = hf.ids_tensor(window, device=hf.device_of(model))
        recall = None
        with torch.no_grad():
            trace = hf.forward(model, ids[:, :t], capture={"h_in"}, last_logits=True)
            with hf.eager(model):
                cont = hf.forward(model, ids[:, t:], cache=hf.make_cache(model, trace.keys, trace.values),
                                  attentions=True, last_logits=True)
                if cfg.recall:  # the model repeating the context: KVzip's reconstruction
                    again = torch.cat([hf.ids_tensor(repeat, device=ids.device), ids[:, :t]], 1)
                    rec = hf.forward(model, again, cache=hf.make_cache(model, trace.keys, trace.values),
                                     attentions=True, last_logits=True)
                    recall = F.reconstruction_attention(rec.attn, t, n_kv)[:, 0]  # (L, Hkv, T)
        future = F.future_attention(cont.attn, t, n_kv)[0][:, 0]  # (L, Hkv, T)
        for layer in range(n_layers):
            h, extra = design_parts(student, trace.h_in[layer][0], trace.values[layer][0], positions.to(ids.device), t)
            normal.add(layer, h, extra, teacher_rows(future[layer], student.config.per_head,
                                                     None if recall is None else recall[layer], cfg.recall))
        normal.rows += t
    return normal


def _samples(model, tokenizer, cfg: FitConfig, split: str, count: int, progress: bool | Reporter) -> list:
    """``count`` contexts of ``split`` prefilled as ``train.prepare`` does (each layer's input kept), on this
    fit's windows; the features see every row (H2O's score, the heuristic line)."""
    tcfg = trainer.TrainConfig(out="unused", corpora=tuple(cfg.corpora), context_len=cfg.context_len,
                               cont_len=cfg.cont_len, question_len=cfg.question_len, keeps=tuple(cfg.keeps))
    tcfg.policy.window = cfg.context_len
    length = cfg.context_len + cfg.question_len + cfg.cont_len
    return trainer.prepare(model, tokenizer, tcfg, split, count, progress, hidden=True,
                           windows=windows(tokenizer, cfg, split, count, length))


def fit(cfg: FitConfig, subject, progress: bool | Reporter = True) -> Student:
    """Fit a student for ``subject`` (a Pair, whose producer is pruned, or (model, tokenizer, source)); returns
    it with ``log``: every ridge's validation KL (mean and per kept fraction), H2O's on the same contexts,
    the chosen ridge and the seconds taken. Writes nothing."""
    model, tokenizer, source = trainer.subject(subject)
    t0 = time.perf_counter()
    base = Student.for_model(model, cfg.student)
    normal = accumulate(model, tokenizer, cfg, base, progress)
    val = _samples(model, tokenizer, cfg, "calib", cfg.val_contexts, progress)
    log = {"config": config.to_dict(cfg), "val": [], "rows": normal.rows}

    def scorer(student: Student):
        return lambda s: torch.cat([student(layer, h, v)[0] for layer, (h, v) in
                                    enumerate(zip(s.obs.hidden, s.obs.values, strict=True))], 0)

    h2o = trainer.validation_kls(model, lambda s: trainer.rows_of_feature(s.obs, True, 0), True, val, cfg.keeps)
    log["val_heuristic"] = round(sum(h2o) / len(h2o), 5)
    best, best_kl = None, math.inf
    for ridge in steps(cfg.ridges, "student: ridge strengths on validation", progress):
        student = Student.for_model(model, StudentConfig(cfg.student.per_head, float(ridge)))
        with torch.no_grad():
            student.weight.copy_(normal.solve(float(ridge)))
        kls = trainer.validation_kls(model, scorer(student), True, val, cfg.keeps)
        mean = sum(kls) / len(kls)
        by_keep = {f"{k:g}": round(sum(kls[i::len(cfg.keeps)]) / len(kls[i::len(cfg.keeps)]), 5)
                   for i, k in enumerate(cfg.keeps)}
        log["val"].append({"ridge": float(ridge), "kl": round(mean, 5), "kl_by_keep": by_keep,
                           "kl_per_context": [round(v, 6) for v in kls]})
        if mean < best_kl:
            best, best_kl = student, mean
    log["h2o_per_context"] = [round(v, 6) for v in h2o]
    log["closed_form_kl"] = round(best_kl, 5)
    steps_kept, closed = 0, best
    if cfg.rl_steps and cfg.student.per_head:
        best, best_kl, steps_kept = reinforce(model, tokenizer, cfg, best, best_kl, val, scorer, log, progress)
    log["seconds"] = round(time.perf_counter() - t0, 1)
    for one, kl, kept in ((closed, log["closed_form_kl"], 0), (best, best_kl, steps_kept)):
        one.identity = {"model_source": source, "model_fingerprint": artefact.fingerprint(model)}
        one.meta = {"val_kl": round(kl, 5), "val_heuristic": log["val_heuristic"], "ridge": one.config.ridge,
                    "train_contexts": cfg.contexts, "rl_steps": kept,
                    "flops_per_token_layer": one.flops_per_token(hf.attn_heads(model)[2])}
        one.log = log
    best.stages = {"closed_form": closed}  # the distilled stage alone (the same student when REINFORCE kept no step)
    return best.eval()


def reinforce(model, tokenizer, cfg: FitConfig, start: Student, start_kl: float, val: list, scorer, log: dict,
              progress: bool | Reporter = True) -> tuple[Student, float, int]:
    """REINFORCE from the closed-form student (the seed's estimator, ``train.reinforce_loss``: M Gumbel top-B
    kept sets per context, reward -KL of the scored continuation, leave-one-out baseline, entropy bonus),
    validated every ``checkpoint_every`` steps; returns (the best validated student, its KL, its step; step 0:
    the closed form itself). Appends the steps and validations to ``log["rl"]``."""
    samples = _samples(model, tokenizer, cfg, "train", cfg.rl_contexts, progress)
    student = copy.deepcopy(start).train()
    opt = torch.optim.Adam(student.parameters(), lr=cfg.lr)
    order, gen = random.Random(cfg.seed), torch.Generator(device=hf.device_of(model)).manual_seed(cfg.seed)
    rl = log.setdefault("rl", {"steps": [], "val": [{"step": 0, "kl": round(start_kl, 5)}]})
    best, best_kl, best_step = start, start_kl, 0
    bar = steps(range(cfg.rl_steps), "student: REINFORCE", progress)
    for step in bar:
        sample = samples[order.randrange(len(samples))]
        keep = cfg.keeps[step % len(cfg.keeps)]
        n_keep = keep_count(sample.obs.n_tokens, keep)
        scores = scorer(student)(sample)  # (L * Hkv, T), with its graph
        rankings = torch.stack([gumbel_top_b(scores.detach(), n_keep, gen) for _ in range(cfg.samples)])
        kls = [trainer.rollout_kl(model, sample, trainer.indices_from_rows(r, sample.obs, True)) for r in rankings]
        loss, entropy = trainer.reinforce_loss(scores, rankings, -torch.tensor(kls, device=scores.device),
                                               cfg.entropy_coef)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rl["steps"].append({"step": step + 1, "keep": keep, "kl": round(sum(kls) / len(kls), 5),
                            "entropy": round(float(entropy), 4)})
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.rl_steps:
            student.eval()
            kls_val = trainer.validation_kls(model, scorer(student), True, val, cfg.keeps)
            student.train()
            mean = sum(kls_val) / len(kls_val)
            rl["val"].append({"step": step + 1, "kl": round(mean, 5), "kl_per_context": [round(v, 6) for v in kls_val]})
            if mean < best_kl:
                best, best_kl, best_step = copy.deepcopy(student).eval(), mean, step + 1
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(val_kl=f"{mean:.4f}", best=f"{best_kl:.4f}")
    return best, best_kl, best_step


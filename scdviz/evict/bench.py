"""Evaluation of eviction methods in one run on the same contexts (``bench evict``).

Per model and context, one eager prefill (``context.observe``) serves the learned policies
(per-head and global) and kvpress's scorers: SnapKV, ObservedAttention (H2O),
StreamingLLM, TOVA, ExpectedAttention, KeyDiff, CUR, LagKV, Knorm and Random, each at
every budget (kept fractions and fixed token counts); a policy with another feature
window costs one more prefill (features only). kvpress's presses that are not plain
scorers (PyramidKV, KVzip, the AdaKV / CriticalKV wrappers) run kvpress's own way, one
prefill each per budget (``hf.press_prefill``); one that cannot run on the model is
reported with its reason. Each pruned cache then teacher-forces the same tail (question +
continuation) from the original positions; the full cache is the reference.

Protocol: contexts come from one slice (``dev`` while iterating, ``test`` for a shipped
policy's final run, from a clean tree; ``scdviz.data``) of the eval split of every shipped
domain, spread evenly through it, the domains in turn; intervals resample whole passages; the
headline policy is the one with the lowest *validation* KL in its training log
(``chosen_on_validation``), never picked by these results. Per budget every method gets
the paired-bootstrap 95% interval of its KL minus the best baseline's, wins against that
baseline and against each context's own best baseline; ``domain_table`` repeats the
comparison per domain.

Modes: ``agnostic`` compresses the context before the question is seen; ``aware``
compresses context + question together. Metrics on the continuation: mean KL(full ||
pruned) and top-1 agreement per step, perplexity, tokens kept, fp16 cache bytes, and
context-QA. Policies trained on one model are applied zero-shot to the others in ``models``.

Sliding-window layers are never compressed (``scdviz.evict.windows``, imported as ``sliding``): every method's
budget applies to the full-attention layers, and the records of a model with window layers say so
(``tokens_kept_in``; their ``cache_bytes`` count the window layers at what a bounded window cache holds); a model
whose every layer is sliding is refused. A student fitted for another model's shapes, or a kvpress press that would
rebuild the family's attention wrongly (``scdviz.evict.kvpress_limits``), is one ``cannot_run`` row saying why.

This module measures quality only: what each method costs in time is ``bench cost``
(scdviz.evict.cost, one harness for every method). It does not train (train.py) and draws
no figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from scdviz import data, metrics, protocol, qa
from scdviz.config import opt
from scdviz.evict import kvpress_limits
from scdviz.evict import windows as sliding
from scdviz.evict.context import Observed, observe, prune, why_not
from scdviz.evict.decode import DECODE_WINDOW, DecodeEvictor
from scdviz.evict.h2o import H2OPress
from scdviz.evict.policy import SHIPPED_DIR, Policy, PolicyConfig, keep_count
from scdviz.evict.press import DistillCachePress
from scdviz.evict.student import Student, StudentPress, is_student
from scdviz.models import hf
from scdviz.records import BenchRecord

SHIPPED_POLICIES = (  # assets/policy/README.md says what each is and how it was made
    SHIPPED_DIR / "per_head" / "best.safetensors",  # DistillCache per layer and KV head, W = 512
    SHIPPED_DIR / "global" / "best.safetensors",  # DistillCache as docs/design.md specifies it: one set
    SHIPPED_DIR / "lookahead_w512" / "best.safetensors",  # + the lookahead feature (G = 40, K = 8): the expensive one
    SHIPPED_DIR / "student_window" / "best.safetensors",  # the distilled linear scorer with a 32-query window
)


@dataclass
class EvalConfig:
    """One benchmark run."""

    policies: tuple[str, ...] = opt((), 'policy and student files; empty: the shipped ones')
    texts: str | None = opt(None, "your text (.txt / .jsonl file, or a folder of train/calib/eval files); its eval "
                            "split replaces the shipped eval splits of corpora")
    corpora: tuple[str, ...] = opt(("austen", "bible", "gcide", "handbook", "jargon", "manpages"),
                                   'shipped corpora whose eval splits are used when texts is None (contexts spread '
                                   'evenly)')
    slice: str = opt("dev", "the slice of each eval split read (scdviz.data): dev while you iterate; test only for "
                     "the final run of a shipped policy, from a clean committed tree", choices=data.SLICES)
    limit: int = opt(66, 'contexts in all, spread evenly through the slice')
    context_len: int = opt(512, 'T, context tokens')
    cont_len: int = opt(32, 'continuation tokens scored')
    keeps: tuple[float, ...] = opt((0.5, 0.25, 0.125), 'kept fractions')
    token_budgets: tuple[int, ...] = opt((64,), 'fixed token budgets')
    question_len: int = opt(16, 'tokens between context and continuation (the "question")')
    modes: tuple[str, ...] = opt(("agnostic",), "agnostic (compress before the question) and/or aware",
                                 choices=("agnostic", "aware"))
    decode_interval: int = opt(8, 'decode-time eviction every this many new tokens')
    qa: bool = opt(False, 'also the context-QA task (scdviz.qa), question-agnostic mode')
    decode_tokens: int = opt(0, "decode-time quality: teacher-force this many tokens of the full cache's greedy "
                             "generation with every cache held at its budget (evicting every decode_interval tokens), "
                             "and answer the QA questions so; 0: skip")
    bos: bool = opt(False, "start every context with the tokenizer's BOS token (Gemma needs it; the SmolLM2 runs use "
                    "none)")
    natives: bool = opt(True, "also kvpress's presses that are not plain scorers (PyramidKV, KVzip, AdaKV / CriticalKV "
                        "wrappers), one prefill each per budget")
    native_names: tuple[str, ...] = opt((), "only these of them (e.g. KVzip while iterating on dev; empty: every one, "
                                        "as a test-slice run needs)")
    scorer_names: tuple[str, ...] = opt((), "only these of kvpress's scorer presses (e.g. ObservedAttention TOVA for a "
                                        "long decode run on many contexts; empty: every one, as a test-slice "
                                        "headline needs)")
    seed: int = opt(0, "seed of the Random baseline and of a lookahead policy's sampled continuations")
    lodo: bool = opt(False, "leave-one-domain-out for the policy: retrain the chosen policy's recipe without each of "
                     "its training domains and score it on that domain (bench.lodo)")
    lodo_steps: int | None = opt(None, "REINFORCE steps of each --lodo retraining (default: the recipe's)")


def baselines(seed: int = 0) -> dict:
    """kvpress scorer presses scored inside the shared eager prefill, by display name."""
    from kvpress import (
        CURPress,
        ExpectedAttentionPress,
        KeyDiffPress,
        KnormPress,
        LagKVPress,
        ObservedAttentionPress,
        RandomPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )

    return {
        "SnapKV": SnapKVPress(),
        "ObservedAttention": ObservedAttentionPress(),
        "StreamingLLM": StreamingLLMPress(),
        "TOVA": TOVAPress(),
        "ExpectedAttention": ExpectedAttentionPress(),
        "KeyDiff": KeyDiffPress(),
        "CUR": CURPress(),
        "LagKV": LagKVPress(),
        "Knorm": KnormPress(),
        "Random": RandomPress(seed=seed),
    }


class _ReadOnce:
    """Stands for ``AutoTokenizer`` inside kvpress's KVzip, which reads the model's tokenizer from disk on
    every prefill (0.7 s on a 2-core CPU, a twentieth of a 512-token eviction request) to build its
    reconstruction prompt: one read per path and thread (fast tokenizers are not safe to share across
    threads), the same tokenizer either way."""

    @staticmethod
    def from_pretrained(path, *args, **kwargs):
        return _tokenizer(str(path), threading.get_ident(), args, tuple(sorted(kwargs.items())))


@functools.cache
def _tokenizer(path: str, _thread: int, args: tuple, kwargs: tuple):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, *args, **dict(kwargs))


def native_baselines() -> dict:
    """kvpress presses that are not plain scorers, run kvpress's own way (``hf.press_prefill``):
    display name -> a function of the compression ratio that builds the press.

    Per-layer budgets (PyramidKV), head-wise budgets (AdaKV, CriticalAdaKV) and KVzip's
    context reconstruction. The wrappers hold SnapKV and ExpectedAttention, the strongest
    scorers they accept: ObservedAttention (H2O) needs eager attention, which kvpress's
    head-wise masking does not cover. FastKVzip is listed so that a run says why it cannot
    run (its trained gates are fetched from a hub and exist for a few models only).
    """
    import kvpress as K
    from kvpress.presses import kvzip_press

    kvzip_press.AutoTokenizer = _ReadOnce  # the same tokenizer, read once (``_ReadOnce``)
    return {
        "PyramidKV": lambda r: K.PyramidKVPress(compression_ratio=r),
        "KVzip": lambda r: K.KVzipPress(compression_ratio=r),
        "AdaKV-SnapKV": lambda r: K.AdaKVPress(K.SnapKVPress(compression_ratio=r)),
        "AdaKV-ExpectedAttention": lambda r: K.AdaKVPress(K.ExpectedAttentionPress(compression_ratio=r)),
        "CriticalKV-SnapKV": lambda r: K.CriticalKVPress(K.SnapKVPress(compression_ratio=r)),
        "CriticalAdaKV-SnapKV": lambda r: K.CriticalAdaKVPress(K.SnapKVPress(compression_ratio=r)),
        "FastKVzip": lambda r: K.FastKVzipPress(compression_ratio=r),
    }


def training_log(path: str | Path) -> dict | None:
    """A policy's training log (``log.json`` beside it), or None."""
    log = Path(path).with_name("log.json")
    return json.loads(log.read_text()) if log.is_file() else None


@dataclass
class LoadedPolicy:
    """A policy (or student) file read once, with its training (fit) log."""

    policy: Policy | Student
    log: dict | None  # log.json beside the file, None when absent

    @property
    def validation_kl(self) -> float | None:
        """The lowest validation KL the log records (a student: its own, ``meta["val_kl"]``), or None."""
        if isinstance(self.policy, Student):
            return self.policy.meta.get("val_kl")
        return _lowest_logged(self.log)

    def validated_like_the_bench(self, question_len: int | None) -> bool:
        """Whether its log validated as the benchmark scores: on the tail after ``question_len`` unscored tokens,
        on windows spread through the calib split (as the bench's are through the eval split)."""
        cfg = (self.log or {}).get("config") or {}
        return cfg.get("question_len") == question_len and cfg.get("spread") is True

    @property
    def trained_on(self) -> list[str] | None:
        """The domains its training contexts came from (the log's settings), or None when unknown."""
        cfg = (self.log or {}).get("config") or {}
        return None if "corpora" not in cfg else (["texts"] if cfg.get("texts") else []) + list(cfg["corpora"])


def _lowest_logged(log: dict | None) -> float | None:
    vals = [v["kl"] for v in (log or {}).get("val", [])]
    return min(vals) if vals else None


def validation_kl(path: str | Path) -> float | None:
    """The lowest validation KL a policy's training log records, or None."""
    return _lowest_logged(training_log(path))


FOCUS_BASELINES = ("ObservedAttention", "SnapKV", "KVzip", "StreamingLLM")  # what a focused comparison shows


def focus_methods() -> list[str]:
    """A focused comparison (the app's default set): the shipped policy chosen on validation (the headline),
    the best validated cheap one (``cheap_on_validation``: the student), the best validated expensive one
    (``expensive_on_validation``: the lookahead, a reference), H2O (ObservedAttention), SnapKV, KVzip and
    StreamingLLM; the full cache is every comparison's reference."""
    question_len = EvalConfig().question_len
    picks = (chosen_on_validation((), question_len), cheap_on_validation((), question_len),
             expensive_on_validation((), question_len))
    return list(dict.fromkeys(m for m in picks if m)) + list(FOCUS_BASELINES)


def method_names() -> list[str]:
    """Every eviction method by display name: the shipped policies and students, kvpress's scorers and its
    native presses."""
    return [*load_all(()), *baselines(), *native_baselines()]


def load_policies(paths: tuple[str, ...]) -> dict[str, Policy]:
    """Feature policies by method name (``policy_name``)."""
    return {name: loaded.policy for name, loaded in load_all(paths).items() if isinstance(loaded.policy, Policy)}


def load_students(paths: tuple[str, ...]) -> dict[str, Student]:
    """Students by method name (``student_name``)."""
    return {name: loaded.policy for name, loaded in load_all(paths).items() if isinstance(loaded.policy, Student)}


def student_presses(students: dict[str, Student]) -> dict[str, StudentPress]:
    """Each student as a press scored in the shared prefill beside kvpress's scorers."""
    return {name: StudentPress(student=s) for name, s in students.items()}


def fitting_students(students: dict[str, Student], model, failed: dict) -> dict[str, Student]:
    """The students fitted for ``model``'s shapes; every other one goes to ``failed`` (name -> why) with
    ``Student.check_model``'s one line naming both shapes."""
    fitting = {}
    for name, student in students.items():
        try:
            student.check_model(model)
            fitting[name] = student
        except ValueError as err:
            failed[name] = str(err)
    return fitting


def chosen_on_validation(paths: tuple[str, ...], question_len: int | None = None) -> str | None:
    """The method name of the policy with the lowest validation KL in its training log:
    the headline policy, chosen without looking at any evaluation result.

    question_len: the benchmark's (None: its default); when some logs validated as it scores (that many
    unscored tokens before the scored ones, windows spread through the split), only those compete."""
    return _lowest_validation(load_all(paths), question_len)


def cheap_on_validation(paths: tuple[str, ...], question_len: int | None = None) -> str | None:
    """As ``chosen_on_validation``, among the policies cheap enough for every prefill and decode step (no
    lookahead: its feature costs several prefills and exists only after one): the app shows it beside the
    headline."""
    loaded = load_all(paths)
    return _lowest_validation({k: v for k, v in loaded.items() if not expensive(v)}, question_len)


def expensive_on_validation(paths: tuple[str, ...], question_len: int | None = None) -> str | None:
    """As ``chosen_on_validation``, among the expensive policies alone (``expensive``): the reference the app
    shows beside the cheap ones."""
    loaded = load_all(paths)
    return _lowest_validation({k: v for k, v in loaded.items() if expensive(v)}, question_len)


def expensive(loaded: LoadedPolicy) -> bool:
    """Whether a policy is the expensive kind the headline excludes (lookahead: sampled continuations)."""
    return isinstance(loaded.policy, Policy) and bool(loaded.policy.config.lookahead)


def _lowest_validation(loaded: dict[str, LoadedPolicy], question_len: int | None = None) -> str | None:
    """The lowest validation KL; when every competing log also holds its heuristic's KL on the same contexts
    (``val_heuristic``, H2O's score), the lowest ratio to it, since logs validate on different contexts. When
    some logs validated like the benchmark (``validated_like_the_bench``; ``question_len`` None: the bench's
    default), only those compete: KLs of another tail, or of first windows (which flatter), are not comparable
    with theirs."""
    question_len = EvalConfig().question_len if question_len is None else question_len
    vals = {name: p.validation_kl for name, p in loaded.items() if p.validation_kl is not None}
    vals = {name: v for name, v in vals.items() if loaded[name].validated_like_the_bench(question_len)} or vals
    lines = {name: (loaded[name].log or {}).get("val_heuristic") for name in vals}
    if vals and all(isinstance(h, (int, float)) and h > 0 for h in lines.values()):
        vals = {name: v / lines[name] for name, v in vals.items()}
    return min(vals, key=vals.get) if vals else None


def load_all(paths: tuple[str, ...]) -> dict[str, LoadedPolicy]:
    """Method name -> the policy and its training log, each file read once."""
    paths = paths or tuple(str(p) for p in SHIPPED_POLICIES if p.is_file())
    out = {}
    for path in paths:
        if is_student(path):
            student = Student.load(path)
            out[_unique(student_name(student), out)] = LoadedPolicy(student, student.log)
            continue
        policy = Policy.load(path)
        name = policy_name(policy)
        if name in out:  # two of a kind: the second by its query window, then a number
            name = f"{name}-w{policy.config.window}"
        out[_unique(name, out)] = LoadedPolicy(policy, policy.log)
    return out


DISTILLCACHE = "DistillCache"  # as docs/design.md specifies it: one token set for all layers
DISTILLCACHE_PER_HEAD = "DistillCache-per-head"  # the same MLP and training, a kept set per layer and KV head
LOOKAHEAD = "lookahead-policy"  # DistillCache's MLP over the five features plus sampled continuations' attention
SCORER = "distilled-scorer"  # the headline: a linear scorer distilled from the future's attention (student.py)
LEARNED = (DISTILLCACHE, LOOKAHEAD, SCORER, "lodo-", "yours:")  # how the names of learned methods start


def policy_name(policy: Policy) -> str:
    """What a REINFORCE-trained policy is: DistillCache (one set for all layers, as specified), DistillCache-per-head,
    or, with the lookahead feature (not in the seed), the lookahead policy."""
    if policy.config.lookahead:
        return LOOKAHEAD
    return DISTILLCACHE_PER_HEAD if policy.config.per_head else DISTILLCACHE


def student_name(student: Student) -> str:
    """What a fitted student is: the distilled scorer (``-per-layer`` when one kept set serves a layer's heads);
    ``-closed-form`` for a per-head one whose listwise stage was not kept (the fit's first stage alone)."""
    listwise = student.meta.get("listwise_penalty") is not None
    return (SCORER + ("" if student.config.per_head else "-per-layer")
            + ("-closed-form" if student.config.per_head and not listwise else ""))


def _unique(name: str, taken: dict) -> str:
    return name if name not in taken else next(f"{name}-{i}" for i in range(2, len(taken) + 3)
                                              if f"{name}-{i}" not in taken)


def contexts(cfg: EvalConfig, tokenizer) -> list:
    """The bench's contexts (``scdviz.data.Window``: ids of context + question + continuation, domain,
    passage), held out from training: spread evenly through the ``cfg.slice`` slice of each eval split.

    Shipped text: the corpora taken in turn so that any ``limit`` spreads the contexts evenly over
    them. A user's file is one domain, "texts".
    """
    length = cfg.context_len + cfg.question_len + cfg.cont_len
    bos = [tokenizer.bos_token_id] if cfg.bos and getattr(tokenizer, "bos_token_id", None) is not None else []
    length -= len(bos)
    if cfg.texts:
        windows = data.eval_windows(tokenizer, data.USER, cfg.slice, length, cfg.limit, cfg.texts, bos)
    else:
        per = -(-cfg.limit // len(cfg.corpora))
        by = [data.eval_windows(tokenizer, c, cfg.slice, length, per, lead=bos) for c in cfg.corpora]
        windows = [item for turn in itertools.zip_longest(*by) for item in turn if item is not None]
    return windows[: cfg.limit]


def budgets(cfg: EvalConfig, n_tokens: int) -> list[tuple[str, int]]:
    """(label, tokens kept) for every kept fraction and fixed budget."""
    out = [(f"{k:g}", keep_count(n_tokens, k)) for k in cfg.keeps]
    return out + [(f"{n}tok", keep_count(n_tokens, int(n))) for n in cfg.token_budgets if n < n_tokens]


def method_indices(
    obs: Observed, feats: dict[int, Observed], policies: dict[str, Policy], label: str, n_keep: int
) -> dict:
    """Kept indices per method: per-layer lists (B, Hkv, n) or one (B, n) set.

    obs carries the press scores; feats the features for each policy's observation
    (``PolicyConfig.observation``: window, lookahead). A sliding-window layer's entry is None (kept whole).
    """
    out = {}
    for name, policy in policies.items():
        feat = feats[policy.config.observation]
        with torch.no_grad():
            if policy.config.per_head:
                out[name] = [None if layer in obs.window_layers else i for layer, i in
                             enumerate(policy(feat.head_features).topk(n_keep, dim=-1).indices.unbind(0))]
            else:
                out[name] = policy(feat.global_features).topk(n_keep, dim=-1).indices
    for (name, lab), scores in obs.scores.items():
        if lab == label:
            out[name] = [None if s is None else s.topk(n_keep, dim=-1).indices for s in scores]
    return out


def observe_context(model, prefix_ids: torch.Tensor, cfg: EvalConfig, policies, presses,
                    failed: dict | None = None) -> tuple[Observed, dict]:
    """The shared eager prefill of one context's compressed part ``prefix_ids`` (1, T): (its observation,
    with every scorer's scores by (name, budget label); each policy view's features by (W, G, K)).
    ``score_context`` runs it, or takes it (``observed``) from a caller who also continues its cache."""
    prefix = prefix_ids.shape[1]
    fracs = {label: n / prefix for label, n in budgets(cfg, prefix)}
    # (window, lookahead G, K) of each policy; without policies, the features of a default policy's view
    views = sorted({p.config.observation for p in policies.values()}) or [PolicyConfig().observation]
    failed = {} if failed is None else failed
    obs = observe(model, prefix_ids, views[0][0], presses, tuple(dict.fromkeys(fracs.values())), failed,
                  views[0][1:], cfg.seed)
    feats = {views[0]: obs} | {v: observe(model, prefix_ids, v[0], lookahead=v[1:], seed=cfg.seed)
                               for v in views[1:]}  # the other policies' observations
    obs.scores = {(name, lab): obs.scores[(name, frac)] for name in presses if name not in failed
                  for lab, frac in fracs.items()}
    return obs, feats


def score_context(model, ids: torch.Tensor, prefix: int, cfg: EvalConfig, policies, presses, qa_item=None,
                  natives: dict | None = None, failed: dict | None = None,
                  observed: tuple[Observed, dict] | None = None) -> dict:
    """All methods x budgets on one context; returns {(method, label): metrics} and timings.

    presses: kvpress scorers, scored in the shared eager prefill; natives: name -> press
    factory (``native_baselines``), each run in its own prefill per budget. failed: name ->
    why it cannot run, filled on a press's first failure and skipped from then on.
    qa_item: optional scdviz.qa.QAItem about the context, answered from every pruned cache.
    observed: ``observe_context(model, ids[:, :prefix], cfg, policies, presses, failed)`` when the caller
    ran it already (the same prefill is not run twice).
    """
    policies = {name: p.to(hf.device_of(model)) for name, p in policies.items()}  # policies move with the model
    failed = {} if failed is None else failed
    obs, feats = observed or observe_context(model, ids[:, :prefix], cfg, policies, presses, failed)
    tail = ids[:, prefix:]
    ref = hf.continue_logits(model, hf.make_cache(model, obs.keys, obs.values), tail, prefix)[0]
    results, kept = {}, {}
    results[("full cache", "full")] = {"nll": _metrics(ref, ref, tail[0], cfg.cont_len)["nll"]}  # the reference's own
    if qa_item is not None:
        results[("full cache", "full")] |= qa.answer(model, hf.make_cache(model, obs.keys, obs.values), qa_item, prefix)
    for label, n_keep in budgets(cfg, prefix):
        chosen = method_indices(obs, feats, policies, label, n_keep)
        caches = {name: prune(model, obs, idx) for name, idx in chosen.items()}
        # one batch per budget: every pruned cache holds n_keep tokens (``hf.continue_each``)
        for (name, cache), logits in zip(caches.items(), hf.continue_each(model, list(caches.values()), tail, prefix),
                                         strict=True):
            results[(name, label)] = _metrics(ref, logits, tail[0], cfg.cont_len) | {"tokens_kept": n_keep} | \
                window_held(model, prefix)
            if qa_item is not None:
                results[(name, label)] |= qa.answer(model, cache, qa_item, prefix)
            kept[(name, label)] = chosen[name]
    if natives:
        natives = {k: v for k, v in natives.items() if k not in failed}
        results |= _score_natives(model, ids, prefix, cfg, ref, natives, failed, qa_item)
    return {"results": results, "feats": feats, "kept": kept, "observed": obs, "ref": ref}


def _score_natives(model, ids, prefix: int, cfg: EvalConfig, ref, natives: dict, failed: dict, qa_item):
    """The native kvpress presses at every budget (their cost: ``bench cost``)."""
    results = {}
    for name, make in natives.items():
        for label, n_keep in budgets(cfg, prefix):
            try:
                with native_scored(model, make, ids, prefix, n_keep, cfg, ref, qa_item) as (row, _):
                    results[(name, label)] = row
            except Exception as err:  # a press that cannot run on this model: reported, never fatal
                failed[name] = why_not(err)
                results = {k: v for k, v in results.items() if k[0] != name}
                break
    return results


@contextlib.contextmanager
def native_scored(model, make, ids: torch.Tensor, prefix: int, n_keep: int, cfg: EvalConfig, ref, qa_item=None):
    """One native press (``make(compression ratio)``) at one budget, its own prefill: yields (its metrics
    against the full cache's logits ``ref``, as ``score_context`` reports them; the pruned cache, valid
    inside the block)."""
    tail = ids[:, prefix:]
    press = make(1.0 - n_keep / prefix)
    kvpress_limits.check(press, model, eager=False)  # SDPA: a press that rebuilds attention must get it right
    with hf.press_prefill(model, press, ids[:, :prefix]) as cache:
        logits = hf.continue_logits(model, cache, tail, prefix)[0]
        row = _metrics(ref, logits, tail[0], cfg.cont_len) | \
            {"tokens_kept": round(sliding.kept_per_head(model, cache), 2)} | window_held(model, prefix)
        if qa_item is not None:
            row |= qa.answer(model, cache, qa_item, prefix)
        yield row, cache


DECODE_BASELINES = ("ObservedAttention", "TOVA", "StreamingLLM", "KeyDiff", "ExpectedAttention", "Knorm")
# decode rows: ObservedAttention's prefill, then every query's attention accumulated (scdviz.evict.h2o): H2O's
# heavy-hitter score without the recent window H2O also reserves, so named for what it is
H2O = "H2O-no-recent"


def decode_context(model, ids: torch.Tensor, prefix: int, cfg: EvalConfig, out: dict, policies: dict,
                   presses: dict, failed: dict, qa_item=None) -> dict:
    """Decode-time quality on one context: every method's prefill selection, then the full
    cache's greedy generation of ``cfg.decode_tokens`` tokens teacher-forced one token at a
    time with the cache held at the budget by ``DecodeEvictor`` (the method scoring, the
    same window and interval for all); KL per step against the full cache.

    ``out``: this context's ``score_context`` result (its prefill, features and kept sets).
    Learned policies: the per-head ones (one set for all layers cannot be held per head); a
    lookahead policy, which DecodeEvictor refuses (its feature exists only after a prefill),
    lands in ``failed`` like any scorer that cannot score while decoding.
    SnapKV is left out: its observation window (64 rows) must exceed the rows a decode
    step buffers. ObservedAttention continues as H2O (``H2O``: every decode row accumulated, not the last
    ``DECODE_WINDOW`` rows over a prefill's visibility, which is what kvpress's score gives a decode step).
    kvpress's ``DecodingPress`` is not used (scdviz.evict.decode says why).
    """
    obs, first = out["observed"], ids[:, prefix : prefix + 1]
    full = hf.make_cache(model, obs.keys, obs.values)
    gen = hf.generate(model, full, first, prefix, cfg.decode_tokens)
    steps = torch.cat([first, hf.ids_tensor(gen[:-1], device=ids.device)], dim=1)
    ref = hf.continue_logits(model, full, steps, prefix)[0]
    scorers = {name: DistillCachePress(policy=p) for name, p in policies.items() if p.config.per_head}
    scorers |= {name: presses[name] for name in DECODE_BASELINES if name in presses}
    scorers |= {name: p for name, p in presses.items() if isinstance(p, StudentPress)}
    if scorers.pop("ObservedAttention", None) is not None:  # while decoding, H2O proper instead of a window of rows:
        scorers[H2O] = H2OPress()  # ObservedAttention's prefill, then every decode row accumulated
    results = {}
    for label, n_keep in budgets(cfg, prefix):
        for name, press in scorers.items():
            at_prefill = "ObservedAttention" if name == H2O else name  # the same prefill scores and kept set
            if name in failed or (at_prefill, label) not in out["kept"]:
                continue
            kept = out["kept"][(at_prefill, label)]
            cache = prune(model, obs, kept)
            # every scorer continues from its kept tokens' true positions; a student from its arrival scores at
            # this context's prefill (score_context scored it last), H2O from the prefill's mean attention
            arrival = ([press.arrival.get(layer) for layer in range(len(obs.keys))] if isinstance(press, StudentPress)
                       else obs.scores[(at_prefill, label)] if name == H2O else None)
            evictor = DecodeEvictor(press, budget=n_keep, window=DECODE_WINDOW, interval=cfg.decode_interval,
                                    prefill_positions=list(kept),  # in cache order (prune keeps it)
                                    prefill_scores=arrival)
            try:
                with evictor(model):
                    logits = hf.continue_logits(model, cache, steps, prefix, one_at_a_time=True)[0]
                    qa_out = qa.answer(model, cache, qa_item, prefix) if qa_item is not None else {}
            except Exception as err:  # a scorer that cannot score while decoding: reported, never fatal
                failed[name] = why_not(err)
                results = {k: v for k, v in results.items() if k[0] != name}
                continue
            results[(name, label)] = (_metrics(ref, logits, steps[0], steps.shape[1]) | {"tokens_kept": n_keep}
                                      | qa_out | window_held(model, prefix + steps.shape[1]))
    return results


def window_held(model, n_tokens: int) -> dict:
    """For a model with sliding-window layers, {"window_tokens": the tokens each of them holds after ``n_tokens``
    (at most its window: what a bounded window cache keeps; they are never compressed)}; {} without them."""
    if not sliding.window_layers(model):
        return {}
    return {"window_tokens": min(n_tokens, hf.family(model).window)}


def _metrics(ref, logits, tail, cont_len: int) -> dict:
    """KL, top-1 and NLL over the continuation part of the tail."""
    r, g = ref[-cont_len:], logits[-cont_len:]
    nll = metrics.nll_per_token(g[:-1], tail[-cont_len + 1 :])
    kl = metrics.kl_per_token(r, g)
    return {
        "kl": float(kl.mean()),
        "kl_steps": kl.tolist(),
        "top1": float(metrics.top1_agreement(r, g).mean()),
        "nll": nll.tolist(),
    }


def run(cfg: EvalConfig, pair, transfer=(), settings: dict | None = None) -> BenchRecord:
    """The eviction bench as a BenchRecord (kind "evict"; rows as ``measure`` gives them).

    pair: the policies' own model, a ``Pair`` (its producer) or a (model, tokenizer, source)
    triple (``scdviz.evict.train.subject``); transfer: more of them, tested zero-shot.
    settings: the record's settings (default: ``cfg``'s, under "eval", as the CLI nests them).
    """
    from scdviz import config
    from scdviz.evict.train import subject

    protocol.check_slice(cfg.slice)
    models = {}
    for one in (pair, *transfer):
        model, tokenizer, source = subject(one)
        models.setdefault(source, (model, tokenizer))
    t0 = time.perf_counter()
    rows = measure(cfg, models)
    device = str(hf.device_of(next(iter(models.values()))[0]))
    return protocol.record("evict", rows, {"eval": config.to_dict(cfg)} if settings is None else settings, cfg.seed,
                           device, time.perf_counter() - t0)


def measure(cfg: EvalConfig, models: dict[str, tuple]) -> list[dict]:
    """Evaluate every loaded model x mode; returns rows (one per model/mode/method/budget).

    models: source -> (model, tokenizer), loaded by the caller; the first is the policies' own,
    the others test zero-shot transfer. Models are only read (eager attention inside a block).
    """
    if unknown := set(cfg.modes) - {"agnostic", "aware"}:
        raise ValueError(f"unknown mode(s) {sorted(unknown)}; use agnostic and/or aware")
    if unknown := set(cfg.scorer_names) - set(baselines()):
        raise ValueError(f"unknown scorer press(es) {sorted(unknown)}; choose from {', '.join(baselines())}")
    if cfg.natives and (unknown := set(cfg.native_names) - set(native_baselines())):
        raise ValueError(f"unknown native press(es) {sorted(unknown)}; choose from {', '.join(native_baselines())}")
    loaded = load_all(cfg.policies)  # each policy file read once
    policies = {name: p.policy for name, p in loaded.items() if isinstance(p.policy, Policy)}
    students = {name: p.policy for name, p in loaded.items() if isinstance(p.policy, Student)}
    if not loaded:
        raise ValueError("no policy: train one with `python -m scdviz train-policy` or pass --policies")
    chosen = _lowest_validation(loaded, cfg.question_len)
    if cfg.lodo and chosen is None:
        raise ValueError("--lodo retrains the policy chosen on validation with its recipe: no policy has a "
                         "training log")
    records_ = []
    for model, _ in models.values():
        sliding.compressed_layers(model)  # a model of sliding-window layers only has nothing to compress: refused
    for source, (model, tokenizer) in models.items():
        windows = contexts(cfg, tokenizer)
        items = ([qa.make_item(tokenizer, w.ids[: cfg.context_len], i) for i, w in enumerate(windows)]
                 if cfg.qa else None)
        for mode in cfg.modes:
            with hf.eager(model):
                records_ += _run_mode(model, source, mode, windows, cfg, policies,
                                      items if mode == "agnostic" else None, chosen, students)
    if cfg.lodo:
        source = next(iter(models))
        records_ += lodo(cfg, *models[source], source, loaded[chosen], chosen)
    for r in records_:
        if r.get("method") in loaded and "trained_on" not in r:
            r["trained_on"] = loaded[r["method"]].trained_on
    return records_


def lodo(cfg: EvalConfig, model, tokenizer, source: str, recipe: LoadedPolicy, chosen: str) -> list[dict]:
    """Leave-one-domain-out for the policy (``scdviz.protocol.by_domain``): for each domain the chosen
    policy was trained on, train its recipe (the settings in its training log) again on the other
    domains, choose the checkpoint on those domains' validation contexts (best.safetensors, written
    with its run into the runs folder), and score it on the left-out domain's eval contexts beside
    every baseline and the shipped policy (mode ``agnostic lodo-<domain>``; the new policy is
    ``lodo-<domain>``, flagged as chosen). The shipped corpora a policy never trained on are held
    out of it already (``trained_on``)."""
    from scdviz import config, runs
    from scdviz.evict import student_fit, train

    is_fit = isinstance(recipe.policy, Student)  # a student's recipe is its closed-form fit
    recipe_cls = student_fit.FitConfig if is_fit else train.TrainConfig
    saved, _ = config.from_dict(recipe_cls, (recipe.log or {}).get("config") or {}, f"{chosen}'s training log")
    domains = [d for d in saved.corpora if d in cfg.corpora]
    if len(saved.corpora) < 2 or getattr(saved, "texts", None) or not domains:
        raise ValueError(f"--lodo needs a policy trained on 2+ shipped domains that are also in --corpora; {chosen} "
                         f"trained on {list(saved.corpora)}")
    per_domain = max(1, -(-cfg.limit // len(cfg.corpora)))

    def fit(others: list[str]) -> tuple[Policy | Student, object]:
        left_out = next(d for d in saved.corpora if d not in others)  # only to name the run
        out = str(runs.new("policies", runs.auto_name(f"lodo-{left_out}")))
        if is_fit:
            fit_cfg = dataclasses.replace(saved, corpora=tuple(others), out=out)
            fitted = student_fit.fit(fit_cfg, (model, tokenizer, source))
            fitted.save(out)  # its run folder, as a policy's checkpoints are
            return fitted, fit_cfg
        train_cfg = dataclasses.replace(
            saved, corpora=tuple(others), steps=saved.steps if cfg.lodo_steps is None else cfg.lodo_steps, out=out)
        return train.train(train_cfg, (model, tokenizer, source), train.checkpoints_to(train_cfg.out)), train_cfg

    def evaluate(domain: str, fitted: tuple[Policy | Student, object]) -> list[dict]:
        policy, train_cfg = fitted
        name = f"lodo-{domain}"
        dcfg = dataclasses.replace(cfg, corpora=(domain,), texts=None, limit=per_domain, lodo=False, qa=False,
                                   decode_tokens=0)
        both = {name: policy, chosen: recipe.policy}
        with hf.eager(model):
            rows = _run_mode(model, source, f"agnostic lodo-{domain}", contexts(dcfg, tokenizer), dcfg,
                             {} if is_fit else both, None, name, both if is_fit else None)
        for r in rows:
            if r.get("method") == name:
                r["trained_on"] = list(train_cfg.corpora)
                r["policy_folder"] = train_cfg.out
        return rows

    results = protocol.by_domain(domains, evaluate, fit=fit, seen=saved.corpora, what="policy")
    return [row for rows in results for row in rows]


def _run_mode(model, source: str, mode: str, windows, cfg: EvalConfig, policies, items=None,
              chosen: str | None = None, students: dict | None = None) -> list[dict]:
    """Every context of one model and mode, aggregated into records (students scored as presses in the
    shared prefill, never counted as baselines)."""
    prefix = cfg.context_len + (cfg.question_len if mode == "aware" else 0)
    failed = {}
    fitting = fitting_students(students or {}, model, failed)  # a student fits one model's shapes: others say so
    base = {k: v for k, v in baselines(cfg.seed).items() if not cfg.scorer_names or k in cfg.scorer_names}
    presses = base | student_presses(fitting)
    natives = {k: v for k, v in native_baselines().items() if not cfg.native_names or k in cfg.native_names
               } if cfg.natives else {}
    per_ctx = []
    decoded, decode_failed = [], {}
    for n, window in enumerate(tqdm(windows, desc=f"{source} {mode}")):
        ids = hf.ids_tensor(window.ids)
        out = score_context(model, ids, prefix, cfg, policies, presses, items[n] if items else None, natives, failed)
        per_ctx.append(out["results"])
        if cfg.decode_tokens:
            decoded.append(decode_context(model, ids, prefix, cfg, out, policies, presses, decode_failed,
                                          items[n] if items else None))
    full_qa = [c.get(("full cache", "full")) for c in per_ctx]  # aggregate pops it
    records = aggregate(per_ctx, model, source, mode, set(base) | set(natives),
                        windows=windows, chosen=chosen, failed=failed)
    if decoded:
        for c, full in zip(decoded, full_qa, strict=True):  # the decode rows' QA beside the full cache's
            if full is not None and "qa_correct" in full:  # (its perplexity was scored on other tokens)
                c[("full cache", "full")] = {k: v for k, v in full.items() if k != "nll"}
        records += aggregate(decoded, model, source, f"{mode} decode{cfg.decode_tokens}", set(base) | {H2O},
                             windows=windows, chosen=chosen, failed=decode_failed)
    return records


def aggregate(
    per_ctx: list[dict], model, source: str, mode: str, baseline_names: set,
    windows: list[data.Window] | None = None, chosen: str | None = None, failed: dict | None = None,
) -> list[dict]:
    """Records with means, standard errors and paired comparisons to the baselines per budget.

    For every method: the paired-bootstrap 95% interval of its KL minus the best baseline's
    (lowest mean KL at that budget) over contexts, wins against that baseline, and wins
    against the best baseline *of each context* (the lowest KL any baseline reached there).
    Per-context KL and each context's domain and passage (``windows``) are kept so tables per
    domain can be drawn.
    ``chosen``: the policy chosen on validation (flagged); ``failed``: baselines that could
    not run, one record each saying why. A method missing on some context is left out. With
    ``windows`` the intervals resample whole passages (the cluster bootstrap).
    """
    n_layers, (_, n_kv, head_dim) = hf.n_layers(model), hf.attn_heads(model)
    n_window = len(sliding.window_layers(model))  # never compressed: they hold their window (``window_held``)
    counted = {"tokens_kept_in": sliding.counted(model)} if n_window else {}
    domains = None if windows is None else [w.domain for w in windows]
    passages = None if windows is None else [w.cluster for w in windows]
    records = []
    full = [c.pop(("full cache", "full")) for c in per_ctx if ("full cache", "full") in c]
    for label in dict.fromkeys(lab for _, lab in per_ctx[0]):
        methods = [m for m, lab in per_ctx[0] if lab == label and all((m, label) in c for c in per_ctx)]
        kl = {m: [c[(m, label)]["kl"] for c in per_ctx] for m in methods}
        base = [m for m in methods if m in baseline_names]
        best = protocol.best_of(kl, base)
        ctx_best = [min(kl[b][i] for b in base) for i in range(len(per_ctx))]
        for m in methods:
            mean, se = metrics.mean_se(kl[m])
            kept = sum(c[(m, label)]["tokens_kept"] for c in per_ctx) / len(per_ctx)
            held = sum(c[(m, label)].get("window_tokens", 0) for c in per_ctx) / len(per_ctx)
            versus = protocol.vs_best(kl, m, base, clusters=passages)
            wins, boot = (None, None) if m == best else (versus["wins"], versus["boot"])
            records.append(
                {
                    "model": source,
                    "mode": mode,
                    "method": m,
                    "keep": label,
                    "tokens_kept": round(kept, 2),
                    "cache_bytes": round(kept * n_layers * n_kv * head_dim * 2 * 2) if not n_window else
                    round((kept * (n_layers - n_window) + held * n_window) * n_kv * head_dim * 2 * 2),
                    "kl": round(mean, 5),
                    "kl_se": round(se, 5),
                    "top1": round(sum(c[(m, label)]["top1"] for c in per_ctx) / len(per_ctx), 4),
                    "ppl": round(metrics.perplexity([x for c in per_ctx for x in c[(m, label)]["nll"]]), 3),
                    "wins_vs_best_baseline": wins,
                    "best_baseline": best,
                    "kl_minus_best": round(boot["diff"], 5) if boot else None,
                    "kl_minus_best_ci95": [round(v, 5) for v in boot["diff_ci"]] if boot else None,
                    "kl_vs_best_ratio": round(boot["ratio"], 4) if boot else None,
                    "wins_vs_context_best": None if m in base else
                    sum(a < b for a, b in zip(kl[m], ctx_best, strict=True)) / len(per_ctx),
                    "baseline": m in baseline_names,
                    "chosen_on_validation": m == chosen,
                    "n_contexts": len(per_ctx),
                    "kl_per_context": [round(v, 6) for v in kl[m]],
                    "domains": domains,
                    "passages": passages,
                }
                | counted
                | _qa_fields([c[(m, label)] for c in per_ctx])
            )
    if full:
        ppl = {"ppl": round(metrics.perplexity([x for c in full for x in c["nll"]]), 3)} if "nll" in full[0] else {}
        records.append({"model": source, "mode": mode, "method": "full cache", "keep": "1",
                        "n_contexts": len(full)} | ppl | _qa_fields(full))
    for name, why in (failed or {}).items():
        records.append({"model": source, "mode": mode, "method": name, "keep": "-", "cannot_run": why})
    return records




def domain_table(records: list[dict], method: str | None = None) -> pd.DataFrame:
    """Per domain and budget: ``method`` (default: the policy chosen on validation, per mode)
    against the best baseline *on that domain's contexts*, with the paired-bootstrap 95%
    interval of the KL difference over those contexts; ``held_out``: the policy never trained
    on that domain (None when its training log is unknown)."""
    rows = [r for r in records if "kl_per_context" in r and r.get("domains")]
    out = []
    for (model, mode, keep) in dict.fromkeys((r["model"], r["mode"], r["keep"]) for r in rows):
        group = {r["method"]: r for r in rows if (r["model"], r["mode"], r["keep"]) == (model, mode, keep)}
        method_ = method or next((m for m, r in group.items() if r.get("chosen_on_validation")), None)
        if method_ not in group:
            continue
        trained = group[method_].get("trained_on")
        kl = {m: r["kl_per_context"] for m, r in group.items()}
        for dom, versus in protocol.per_domain(group[method_]["domains"], kl, method_,
                                               [m for m, r in group.items() if r["baseline"]],
                                               clusters=group[method_].get("passages")):
            boot = versus["boot"]
            out.append({"model": model, "mode": mode, "keep": keep, "domain": dom, "n": versus["n"], "method": method_,
                        "held_out": None if trained is None else dom not in trained,
                        "kl": round(versus["mean"], 4), "best_baseline": versus["best"],
                        "best_kl": round(versus["best_mean"], 4),
                        "minus_best": round(boot["diff"], 4) if boot else None,
                        "ci95": [round(v, 4) for v in boot["diff_ci"]] if boot else None,
                        "wins": versus["wins"]})
    return pd.DataFrame(out)


def _qa_fields(rows: list[dict]) -> dict:
    """Context-QA accuracy and answer F1 over contexts, when the QA task ran."""
    if not rows or "qa_correct" not in rows[0]:
        return {}
    return {"qa_acc": round(sum(r["qa_correct"] for r in rows) / len(rows), 4),
            "qa_f1": round(sum(r["qa_f1"] for r in rows) / len(rows), 4)}


def _short(model: str, width: int = 18) -> str:
    """A model source as a table cell: builtin:NAME -> NAME, a path -> its folder name."""
    name = model.split(":", 1)[1] if model.startswith("builtin:") else Path(model.rstrip("/")).name or model
    return name[:width]


def table(records: list[dict]) -> pd.DataFrame:
    """The records as the CLI prints them (``scdviz.protocol.show``): one row per method and budget,
    the policy chosen on validation marked *, KL - best baseline with its 95% interval, wins against
    that baseline (``best`` for the best itself) and against each context's best (ctx), and QA
    accuracy; a full-cache row gives the reference's perplexity, a press that cannot run says why."""
    out = []
    for r in records:
        row = {"model": _short(r["model"]), "mode": r["mode"],
               "method": r["method"] + ("*" if r.get("chosen_on_validation") else ""), "keep": r["keep"]}
        if "cannot_run" in r:
            out.append(row | {"note": f"cannot run: {r['cannot_run']}"})
            continue
        if "kl" not in r:  # the full-cache row: the reference's perplexity and QA accuracy
            out.append(row | {"ppl": r.get("ppl"), "qa_acc": r.get("qa_acc")})
            continue
        wins = "best" if r["wins_vs_best_baseline"] is None else f"{r['wins_vs_best_baseline']:.2f}"
        diff = "" if r.get("kl_minus_best") is None else \
            f"{r['kl_minus_best']:+.4f} {protocol.interval(r['kl_minus_best_ci95'], '+.4f')}"
        out.append(row | {"kl": f"{r['kl']:.4f}±{r['kl_se']:.4f}", "top1": round(r["top1"], 3),
                          "ppl": round(r["ppl"], 2), "kl_minus_best_ci95": diff, "wins": wins,
                          "ctx_wins": (None if r.get("wins_vs_context_best") is None
                                       else round(r["wins_vs_context_best"], 2)),
                          "qa_acc": r.get("qa_acc")})
    return pd.DataFrame(out)


def domain_text(rows: pd.DataFrame | list[dict]) -> str:
    """``domain_table`` as plain text (``scdviz.protocol.show``): models by short name, wins to 2 places."""
    table = pd.DataFrame(rows)
    if len(table):
        table = table.assign(model=table["model"].map(_short), wins=table["wins"].round(2))
    return protocol.show(table)

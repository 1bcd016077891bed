"""Evaluation of eviction methods in one run on the same contexts (``bench evict``).

Per model and context, one eager prefill (``context.observe``) serves every method: the
learned policies (per-head and global) and kvpress's SnapKV, ObservedAttention (H2O),
StreamingLLM, TOVA, ExpectedAttention, Knorm and Random, each at every budget (kept
fractions and fixed token counts); a policy with another feature window costs one more
prefill (features only). Each pruned cache then teacher-forces the same tail
(question + continuation) from the original positions; the full cache is the reference.

Modes: ``agnostic`` compresses the context before the question is seen; ``aware``
compresses context + question together. Metrics on the continuation: mean KL(full ||
pruned) and top-1 agreement per step, perplexity, paired per-context wins vs the best
kvpress baseline, tokens kept, fp16 cache bytes, scoring time as a fraction of the
prefill (overhead_frac), decode speed-up of the pruned cache vs the full one, and the
learned policy's cost while evicting at decode time (decode_overhead_frac).
Policies trained on one model are applied zero-shot to the others in ``models``.

This module does not train (trainer.py) and draws no figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from scdviz import metrics, qa, settings
from scdviz.config import opt
from scdviz.evict.context import Observed, observe, prune
from scdviz.evict.decode import DecodeEvictor
from scdviz.evict.policy import Policy, keep_count
from scdviz.evict.press import DistillCachePress
from scdviz.models import hf

SHIPPED_POLICIES = (
    settings.ASSETS_DIR / "policy" / "per_head" / "best.safetensors",  # per-head, W = 512
    settings.ASSETS_DIR / "policy" / "global" / "best.safetensors",  # one set for all layers (as specified)
    settings.ASSETS_DIR / "policy" / "per_head_w64" / "best.safetensors",  # per-head, W = 64
)


@dataclass
class EvalConfig:
    """One benchmark run."""

    policies: tuple[str, ...] = opt((), 'policy files; empty: the shipped ones')
    texts: str | None = opt(None, '.txt / .jsonl passages; None: shipped eval splits of ``corpora``')
    corpora: tuple[str, ...] = opt(("jargon", "bible"), 'shipped corpora used when texts is None')
    limit: int = opt(16, 'contexts')
    context_len: int = opt(512, 'T, context tokens')
    cont_len: int = opt(32, 'continuation tokens scored')
    keeps: tuple[float, ...] = opt((0.5, 0.25, 0.125), 'kept fractions')
    token_budgets: tuple[int, ...] = opt((64,), 'fixed token budgets')
    question_len: int = opt(16, 'tokens between context and continuation (the "question")')
    modes: tuple[str, ...] = opt(("agnostic",), "agnostic (compress before the question) and/or aware", choices=("agnostic", "aware"))
    throughput_contexts: int = opt(2, 'contexts on which decode speed is timed')
    decode_steps: int = opt(32, 'greedy steps per throughput timing')
    decode_interval: int = opt(8, 'decode-time eviction every this many new tokens')
    qa: bool = opt(False, 'also the context-QA task (scdviz.qa), question-agnostic mode')
    seed: int = opt(0, "seed of the Random baseline")


def baselines(seed: int = 0) -> dict:
    """kvpress presses compared against, by display name."""
    from kvpress import (
        ExpectedAttentionPress,
        KnormPress,
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
        "Knorm": KnormPress(),
        "Random": RandomPress(seed=seed),
    }


def load_policies(paths: tuple[str, ...]) -> dict[str, Policy]:
    """Policies by method name (distillcache-head / distillcache-global)."""
    paths = paths or tuple(str(p) for p in SHIPPED_POLICIES if p.is_file())
    policies = {}
    for path in paths:
        policy = Policy.load(path)
        name = "distillcache-head" if policy.config.per_head else "distillcache-global"
        policies[name if name not in policies else f"{name}-w{policy.config.window}"] = policy
    return policies


def contexts(cfg: EvalConfig, tokenizer) -> list[list[int]]:
    """Token windows of context + question + continuation, held out from training."""
    from scdviz import data

    length = cfg.context_len + cfg.question_len + cfg.cont_len
    if cfg.texts:
        windows = data.token_windows(tokenizer, data.read_passages(cfg.texts), length, cfg.limit)
    else:
        per = -(-cfg.limit // len(cfg.corpora))
        windows = [
            w for c in cfg.corpora for w in data.token_windows(tokenizer, data.load_split(c, "eval"), length, per)
        ]
    if not windows:
        raise ValueError(f"no window of {length} tokens in the texts; lower --context-len or give longer texts")
    return windows[: cfg.limit]


def budgets(cfg: EvalConfig, n_tokens: int) -> list[tuple[str, int]]:
    """(label, tokens kept) for every kept fraction and fixed budget."""
    out = [(f"{k:g}", keep_count(n_tokens, k)) for k in cfg.keeps]
    return out + [(f"{n}tok", keep_count(n_tokens, int(n))) for n in cfg.token_budgets if n < n_tokens]


def method_indices(
    obs: Observed, feats: dict[int, Observed], policies: dict[str, Policy], label: str, n_keep: int
) -> dict:
    """Kept indices per method: per-layer lists (B, Hkv, n) or one (B, n) set.

    obs carries the press scores; feats the features for each policy window.
    """
    out = {}
    for name, policy in policies.items():
        feat = feats[policy.config.window]
        with torch.no_grad():
            if policy.config.per_head:
                out[name] = list(policy(feat.head_features).topk(n_keep, dim=-1).indices.unbind(0))
            else:
                out[name] = policy(feat.global_features).topk(n_keep, dim=-1).indices
    for (name, lab), scores in obs.scores.items():
        if lab == label:
            out[name] = [s.topk(n_keep, dim=-1).indices for s in scores]
    return out


def _policy_seconds(feats: dict[int, Observed], policies: dict[str, Policy]) -> dict[str, float]:
    """Scoring time per learned policy: its share of the feature time plus the MLP."""
    out = {}
    for name, policy in policies.items():
        feat = feats[policy.config.window]
        t0 = time.perf_counter()
        with torch.no_grad():
            policy(feat.head_features if policy.config.per_head else feat.global_features)
        out[name] = feat.feature_seconds / 2 + time.perf_counter() - t0
    return out


def score_context(model, ids: torch.Tensor, prefix: int, cfg: EvalConfig, policies, presses, qa_item=None) -> dict:
    """All methods x budgets on one context; returns {(method, label): metrics} and timings.

    qa_item: optional scdviz.qa.QAItem about the context, answered from every pruned cache.
    """
    policies = {name: p.to(hf.device_of(model)) for name, p in policies.items()}  # policies move with the model
    fracs = {label: n / prefix for label, n in budgets(cfg, prefix)}
    windows = sorted({p.config.window for p in policies.values()})
    obs = observe(model, ids[:, :prefix], windows[0], presses, tuple(dict.fromkeys(fracs.values())))
    feats = {windows[0]: obs} | {w: observe(model, ids[:, :prefix], w) for w in windows[1:]}  # other windows
    obs.scores = {(name, lab): obs.scores[(name, frac)] for name in presses for lab, frac in fracs.items()}
    tail = ids[:, prefix:]
    ref = hf.continue_logits(model, hf.make_cache(model, obs.keys, obs.values), tail, prefix)[0]
    results, kept = {}, {}
    if qa_item is not None:
        results[("full cache", "full")] = qa.answer(model, hf.make_cache(model, obs.keys, obs.values), qa_item, prefix)
    for label, n_keep in budgets(cfg, prefix):
        for name, idx in method_indices(obs, feats, policies, label, n_keep).items():
            cache = prune(model, obs, idx)
            logits = hf.continue_logits(model, cache, tail, prefix)[0]
            results[(name, label)] = _metrics(ref, logits, tail[0], cfg.cont_len) | {"tokens_kept": n_keep}
            if qa_item is not None:
                results[(name, label)] |= qa.answer(model, cache, qa_item, prefix)
            kept[(name, label)] = idx
    seconds = _policy_seconds(feats, policies) | obs.score_seconds
    overhead = {k: v / obs.prefill_seconds for k, v in seconds.items()}
    return {"results": results, "overhead": overhead, "feats": feats, "kept": kept, "observed": obs}


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


def decode_timing(model, obs: Observed, first: torch.Tensor, start: int, n_keep: int, cfg: EvalConfig, policy) -> dict:
    """Greedy-decode seconds with the full cache, a pruned cache, and decode-time eviction."""
    full = hf.make_cache(model, obs.keys, obs.values)
    t0 = time.perf_counter()
    hf.generate(model, full, first, start, cfg.decode_steps)
    t_full = time.perf_counter() - t0
    idx = list(policy(obs.head_features).topk(n_keep, dim=-1).indices.unbind(0))
    t0 = time.perf_counter()
    hf.generate(model, prune(model, obs, idx), first, start, cfg.decode_steps)
    t_pruned = time.perf_counter() - t0
    evictor = DecodeEvictor(DistillCachePress(policy=policy), budget=n_keep, interval=cfg.decode_interval)
    t0 = time.perf_counter()
    with evictor(model):
        hf.generate(model, prune(model, obs, idx), first, start, cfg.decode_steps)
    t_evict = time.perf_counter() - t0
    return {"speedup": t_full / t_pruned, "decode_overhead_frac": evictor.score_seconds / t_evict}


def run(cfg: EvalConfig, models: dict[str, tuple]) -> list[dict]:
    """Evaluate every loaded model x mode; returns rows (one per model/mode/method/budget).

    models: source -> (model, tokenizer), loaded by the caller; the first is the policies' own,
    the others test zero-shot transfer. Models are only read (eager attention inside a block).
    """
    if unknown := set(cfg.modes) - {"agnostic", "aware"}:
        raise ValueError(f"unknown mode(s) {sorted(unknown)}; use agnostic and/or aware")
    policies = load_policies(cfg.policies)
    if not policies:
        raise ValueError("no policy: train one with `python -m scdviz train-policy` or pass --policies")
    records = []
    for source, (model, tokenizer) in models.items():
        windows = contexts(cfg, tokenizer)
        items = [qa.make_item(tokenizer, w[: cfg.context_len], i) for i, w in enumerate(windows)] if cfg.qa else None
        for mode in cfg.modes:
            with hf.eager(model):
                records += _run_mode(model, source, mode, windows, cfg, policies, items if mode == "agnostic" else None)
    return records


def _run_mode(model, source: str, mode: str, windows, cfg: EvalConfig, policies, items=None) -> list[dict]:
    """Every context of one model and mode, aggregated into records."""
    prefix = cfg.context_len + (cfg.question_len if mode == "aware" else 0)
    presses = baselines(cfg.seed)
    per_ctx, overhead, timing = [], {}, {}
    head = next((p for p in policies.values() if p.config.per_head), None)
    for n, window in enumerate(tqdm(windows, desc=f"{source} {mode}")):
        ids = hf.ids_tensor(window)
        out = score_context(model, ids, prefix, cfg, policies, presses, items[n] if items else None)
        per_ctx.append(out["results"])
        for k, v in out["overhead"].items():
            overhead.setdefault(k, []).append(v)
        if head is not None and n < cfg.throughput_contexts:
            for label, n_keep in budgets(cfg, prefix):
                t = decode_timing(
                    model, out["feats"][head.config.window], ids[:, prefix : prefix + 1], prefix, n_keep, cfg, head
                )
                timing.setdefault(label, []).append(t)
    return aggregate(per_ctx, overhead, timing, model, source, mode, set(presses))


def aggregate(
    per_ctx: list[dict], overhead: dict, timing: dict, model, source: str, mode: str, baseline_names: set
) -> list[dict]:
    """Records with means, standard errors and paired wins vs the best baseline per budget."""
    n_layers, (_, n_kv, head_dim) = hf.n_layers(model), hf.attn_heads(model)
    records = []
    full = [c.pop(("full cache", "full")) for c in per_ctx if ("full cache", "full") in c]
    for label in dict.fromkeys(lab for _, lab in per_ctx[0]):
        methods = [m for m, lab in per_ctx[0] if lab == label]
        kl = {m: [c[(m, label)]["kl"] for c in per_ctx] for m in methods}
        best = min((m for m in methods if m in baseline_names), key=lambda m: sum(kl[m]))
        for m in methods:
            mean, se = metrics.mean_se(kl[m])
            kept = per_ctx[0][(m, label)]["tokens_kept"]
            wins = None if m == best else sum(a < b for a, b in zip(kl[m], kl[best], strict=True)) / len(per_ctx)
            t = timing.get(label, [])
            records.append(
                {
                    "model": source,
                    "mode": mode,
                    "method": m,
                    "keep": label,
                    "tokens_kept": kept,
                    "cache_bytes": kept * n_layers * n_kv * head_dim * 2 * 2,
                    "kl": round(mean, 5),
                    "kl_se": round(se, 5),
                    "top1": round(sum(c[(m, label)]["top1"] for c in per_ctx) / len(per_ctx), 4),
                    "ppl": round(metrics.perplexity([x for c in per_ctx for x in c[(m, label)]["nll"]]), 3),
                    "wins_vs_best_baseline": wins,
                    "best_baseline": best,
                    "n_contexts": len(per_ctx),
                    "overhead_frac": round(sum(overhead[m]) / len(overhead[m]), 4),
                    "decode_speedup": round(sum(x["speedup"] for x in t) / len(t), 3) if t else None,
                    "decode_overhead_frac": round(sum(x["decode_overhead_frac"] for x in t) / len(t), 4)
                    if t and m == "distillcache-head"
                    else None,
                }
                | _qa_fields([c[(m, label)] for c in per_ctx])
            )
    if full:
        records.append({"model": source, "mode": mode, "method": "full cache", "keep": "1",
                        "n_contexts": len(full)} | _qa_fields(full))
    return records


def _qa_fields(rows: list[dict]) -> dict:
    """Context-QA accuracy and answer F1 over contexts, when the QA task ran."""
    if not rows or "qa_correct" not in rows[0]:
        return {}
    return {"qa_acc": round(sum(r["qa_correct"] for r in rows) / len(rows), 4),
            "qa_f1": round(sum(r["qa_f1"] for r in rows) / len(rows), 4)}


def table(records: list[dict]) -> str:
    """A plain-text table of the records."""
    head = f"{'model':22} {'mode':8} {'method':22} {'keep':>6} {'KL':>14} {'top1':>6} {'PPL':>8} {'wins':>5} {'ovh':>6} {'speed':>6}"
    lines = [head, "-" * len(head)]
    for r in records:
        if "kl" not in r:  # the full-cache QA row
            lines.append(f"{r['model'][-22:]:22} {r['mode']:8} {r['method']:22} {'1':>6}  QA acc {r['qa_acc']:.3f}")
            continue
        qa_text = f" QA {r['qa_acc']:.3f}" if "qa_acc" in r else ""
        wins = "best" if r["wins_vs_best_baseline"] is None else f"{r['wins_vs_best_baseline']:.2f}"
        speed = "" if r["decode_speedup"] is None else f"{r['decode_speedup']:.2f}"
        lines.append(
            f"{r['model'][-22:]:22} {r['mode']:8} {r['method']:22} {r['keep']:>6} {r['kl']:7.4f}±{r['kl_se']:.4f} "
            f"{r['top1']:6.3f} {r['ppl']:8.2f} {wins:>5} {r['overhead_frac']:6.3f} {speed:>6}{qa_text}"
        )
    return "\n".join(lines)

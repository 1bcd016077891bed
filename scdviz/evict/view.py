"""One context, every eviction method: what each keeps and what it costs (the app's view).

``eviction_view`` runs the benchmark's own ``score_context`` on a single user context (so the
numbers equal ``bench evict`` on the same window and settings) and adds what a person
wants to look at: which tokens each method keeps (fraction of layer × KV-head slots
keeping each token), where each method's choice differs from H2O's (ObservedAttention:
what attention history alone keeps) with the overlap of their kept slots, KL per decode
step, the budget sweep, the tokens' features, and greedy text generated from each pruned
cache. The continuation scored is the full
cache's own greedy generation. No figures here (scdviz.plots), no training.

Sliding-window layers are never compressed (``scdviz.evict.windows``): their rows of the per-layer view keep
every token, and the kept shares, agreements and counts are over the full-attention layers (``counted`` says so);
a model whose every layer is sliding is refused. A scorer fitted for another model's shapes is one line in
``failed`` naming both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from scdviz.evict import bench, windows
from scdviz.evict.context import prune, why_not
from scdviz.evict.features import LOOKAHEAD, NAMES
from scdviz.evict.policy import keep_count
from scdviz.evict.student import Student
from scdviz.models import hf
from scdviz.progress import Reporter, steps, tell

SWEEP = (0.5, 0.25, 0.125)  # kept fractions of the budget sweep


@dataclass
class EvictionView:
    """Everything the eviction tab shows for one context."""

    context_tokens: list[str]  # (T,) decoded tokens of the compressed part
    budget_label: str  # the chosen budget's label ("0.25" or "64tok")
    tokens_kept: int  # tokens kept per (full-attention) layer / head at the chosen budget (``counted``)
    kept_fraction: dict[str, list[float]]  # method -> (T,) share of full-attention layer×head slots keeping token i
    kept_per_layer: dict[str, list[list[float]]]  # method -> (L, T) share of KV heads keeping token i (a
    #   sliding-window layer: 1 everywhere, never compressed)
    kl_steps: dict[str, list[float]]  # method -> KL(full ‖ pruned) per scored continuation step
    sweep: dict[str, dict[float, float]]  # method -> kept fraction -> mean KL
    rows: list[dict]  # method, kl, top1, ppl at the chosen budget
    features: list[list[float]]  # (T, 5) global-form features of every context token
    feature_names: tuple[str, ...] = NAMES  # names of the features (5, or 6 with the lookahead)
    continuation: str = ""  # the full cache's greedy continuation (the scored tokens)
    generations: dict[str, str] = field(default_factory=dict)  # method -> greedy text from its pruned cache
    versus_h2o: dict[str, list[float]] = field(default_factory=dict)  # method -> (T,) its kept share minus H2O's
    failed: dict[str, str] = field(default_factory=dict)  # method -> why it could not run on this model
    counted: str = "per layer and KV head"  # what ``tokens_kept`` counts (``windows.counted``)


H2O = "ObservedAttention"  # kvpress's H2O: what attention history alone keeps


def slot_masks(idx, n_tokens: int, n_layers: int, n_kv: int, whole: tuple | list = ()) -> torch.Tensor:
    """(L, Hkv, T) 1 where a layer's KV head keeps a token, from per-layer (B, Hkv, n) or one (B, n) set; the layers
    in ``whole`` (sliding-window layers) and a layer whose indices are None keep every token."""
    per_layer = idx if isinstance(idx, list) else [idx] * n_layers
    rows = []
    for layer, i in enumerate(per_layer):
        if i is None or layer in whole:
            rows.append(torch.ones(n_kv, n_tokens, device=hf.HOST))
            continue
        i = (i[0] if i.dim() == 3 else i).expand(n_kv, -1)  # (Hkv, n); one set is every head's
        mask = torch.zeros(n_kv, n_tokens, device=hf.HOST)  # for the plots
        mask.scatter_(1, i.cpu(), 1.0)
        rows.append(mask)
    return torch.stack(rows)


def agreement(mask: torch.Tensor, reference: torch.Tensor) -> dict:
    """How a method's kept slots (L, Hkv, T) compare with a reference's: Jaccard overlap and the
    share of its kept slots the reference drops."""
    both, either = (mask * reference).sum(), ((mask + reference) > 0).sum()
    return {"jaccard_vs_h2o": round(float(both / either.clamp_min(1)), 3),
            "kept_not_by_h2o": round(float(1 - both / mask.sum().clamp_min(1)), 3)}


def eviction_view(model, tokenizer, context: str, question: str = "", keep: float | int = 0.25, aware: bool = False,
                  lengths: tuple[int, int] = (24, 16), policies: dict | None = None,
                  methods: list[str] | None = None, progress: bool | Reporter = False) -> EvictionView:
    """Compress ``context`` (plus ``question`` when aware) with each method at ``keep`` and compare.

    lengths: (tokens of the full cache's continuation scored, tokens generated from each pruned cache).
    policies: extra learned policies and distilled scorers (``Student``) by method name (e.g. one a user just
    trained or fitted) beside the shipped ones, always run. methods: the shipped policies, kvpress scorers and
    native presses to run (None: all; H2O always runs, as every method is compared with it). Native presses (KVzip,
    PyramidKV, ...) prune inside kvpress, so their rows, curves and texts are shown but not which tokens they keep;
    each costs a prefill per budget, so they run at the chosen budget only (in the sweep: one point).
    progress: a reporter (``scdviz.progress``) told each phase and each method's generation.
    """
    windows.compressed_layers(model)  # a model of sliding-window layers only has nothing to compress: refused
    cont_len, gen_tokens = lengths
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    q = tokenizer(question, add_special_tokens=False)["input_ids"] if question.strip() else []
    wanted = None if methods is None else set(methods) | {H2O}
    presses = {k: v for k, v in bench.baselines().items() if wanted is None or k in wanted}
    # the shipped students score inside the same prefill, as presses do (they read each layer's input)
    students = {k: v for k, v in bench.load_students(()).items() if wanted is None or k in wanted}
    students |= {k: v for k, v in (policies or {}).items() if isinstance(v, Student)}  # a visitor's own
    policies = {k: v for k, v in (policies or {}).items() if not isinstance(v, Student)}
    failed: dict = {}  # method -> why it cannot run here (a student fitted for other shapes: check_model's line)
    presses |= bench.student_presses(bench.fitting_students(students, model, failed))
    natives = {k: v for k, v in bench.native_baselines().items() if wanted is not None and k in wanted}
    # window-based scorers (SnapKV: 64 query rows) need a compressed part longer than their window
    need = max([16, *(int(getattr(p, "window_size", 0)) + 1 for p in presses.values())])
    prompt = ctx + q
    prefix = len(prompt) - 1 if (aware or not q) else len(ctx)  # the compressed part
    if prefix < need:
        raise ValueError(f"the context has {prefix} tokens to compress; give at least {need} (SnapKV scores "
                         f"with a {need - 1}-token observation window)")
    if isinstance(keep, int) and not keep < prefix:
        raise ValueError(f"a budget of {keep} tokens keeps the whole {prefix}-token context; choose fewer")
    with hf.eager(model):  # restored on exit: the model may be shared by other requests
        ids = hf.ids_tensor(prompt)
        label = f"{keep:g}" if isinstance(keep, float) else f"{keep}tok"
        keeps = tuple(sorted(set(SWEEP) | ({keep} if isinstance(keep, float) else set()), reverse=True))
        cfg = bench.EvalConfig(keeps=keeps, token_budgets=(keep,) if isinstance(keep, int) else (), cont_len=cont_len)
        shipped = {k: v for k, v in bench.load_policies(()).items() if wanted is None or k in wanted}
        policies = shipped | policies
        tell(progress, f"one eager prefill: {len(presses)} scorers and {len(policies)} policies at each budget", 0, 1)
        policies = {name: p.to(hf.device_of(model)) for name, p in policies.items()}
        observed = bench.observe_context(model, ids[:, :prefix], cfg, policies, presses, failed)
        # texts need only the kept sets, not the continuation: the full cache's continuation (the scored
        # tokens) and every pruned cache's text are decoded in one batch
        chosen = bench.method_indices(*observed, policies, label, keep_count(prefix, keep))
        masked = sorted(chosen)
        tell(progress, f"the full cache's continuation and text from the {len(masked)} pruned caches (one batch)", 0, 1)
        caches = [hf.make_cache(model, observed[0].keys, observed[0].values)]
        caches += [prune(model, observed[0], chosen[m]) for m in masked]
        with hf.attention(model, "sdpa"):  # greedy tokens only: no attention probabilities needed
            texts = hf.generate_each(model, caches, ids[:, prefix:], prefix, [cont_len] + [gen_tokens] * len(masked))
        cont = texts[0]
        gens = {m: tokenizer.decode(t) for m, t in zip(masked, texts[1:], strict=True)}
        tell(progress, "every method's pruned cache scored on the continuation", 0, 1)
        window = hf.ids_tensor(prompt + cont)
        out = bench.score_context(model, window, prefix, cfg, policies, presses, failed=failed, observed=observed)
        n_layers, n_kv = hf.n_layers(model), hf.attn_heads(model)[1]
        whole = windows.window_layers(model)
        slots = {m: slot_masks(i, prefix, n_layers, n_kv, whole) for (m, lab), i in out["kept"].items()
                 if lab == label}
        masks = {m: s.mean(1) for m, s in slots.items()}
        full = {m: windows.compressed(model, s) for m, s in slots.items()}  # the layers eviction compresses
        res = out["results"]
        feats = out["feats"][min(out["feats"])].global_features[0]
        # a native press prunes inside its own prefill (one per budget): the chosen budget only, its text
        # generated from the same prefill
        for name, make in steps(natives.items(), "native presses (their own prefill each)", progress,
                                name=lambda item: item[0]):
            try:
                with bench.native_scored(model, make, window, prefix, keep_count(prefix, keep), cfg, out["ref"]) \
                        as (row, cache):
                    res[(name, label)] = row
                    gens[name] = tokenizer.decode(hf.generate(model, cache, ids[:, prefix:], prefix, gen_tokens))
            except Exception as err:  # a press that cannot run on this model: said, never fatal
                failed[name] = why_not(err)
        shown = masked + [k for k in natives if k in gens]
    return EvictionView(
        context_tokens=[tokenizer.decode([t]) for t in prompt[:prefix]],
        budget_label=label,
        tokens_kept=keep_count(prefix, keep),
        kept_fraction={m: full[m].mean((0, 1)).tolist() if whole else masks[m].mean(0).tolist() for m in masked},
        kept_per_layer={m: masks[m].tolist() for m in masked},
        kl_steps={m: res[(m, label)]["kl_steps"] for m in shown},
        sweep={m: {k: res[(m, f"{k:g}")]["kl"] for k in keeps if (m, f"{k:g}") in res} for m in shown},
        rows=[{"method": m, "kl": round(res[(m, label)]["kl"], 4), "top1": round(res[(m, label)]["top1"], 3),
               "tokens_kept": res[(m, label)]["tokens_kept"]} | (agreement(full[m], full[H2O]) if m in slots else {})
              for m in shown],
        features=feats.tolist(),
        feature_names=NAMES + ((LOOKAHEAD,) if feats.shape[-1] > len(NAMES) else ()),
        continuation=tokenizer.decode(cont),
        generations={m: gens[m] for m in shown},
        versus_h2o={m: (full[m].mean((0, 1)) - full[H2O].mean((0, 1))).tolist() for m in masked},
        failed=failed,
        counted=windows.counted(model),
    )


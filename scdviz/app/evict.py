"""The DistillCache tab's work: every eviction method on one context (``EvictRequest``)."""

from __future__ import annotations

import functools
import math

from scdviz import settings
from scdviz.app import inputs
from scdviz.app.inputs import UserError
from scdviz.app.requests import HEADLINE_SCORER, EvictRequest
from scdviz.models.pair import Pair

QUESTION = "\n\nQuestion: {}\nAnswer:"  # how a question follows the context (a base-model prompt, no chat tokens)

# what each method is to a visitor: the table's ``role`` column, and the words the tab's texts use for them
HEADLINE = "headline"  # the shipped distilled scorer (``HEADLINE_SCORER``)
REFERENCE = "reference (expensive)"  # the lookahead policy: it samples continuations at every prefill
LEARNED_OTHER = "learned (not the headline)"  # DistillCache as designed, its per-head form, the scorer's variants
YOURS = "yours"  # a policy or scorer this visitor trained or loaded
BASELINE = "baseline"  # kvpress's presses
H2O = "ObservedAttention"  # the one name the tab gives kvpress's H2O score (scdviz.evict.view.H2O; the methods' value)
# the docs section with the benchmark's numbers for the headline (the note when one context disagrees)
BENCH_DOCS = "docs/results.md#the-protocol-66-contexts-of-the-test-slice-six-domains"


def role(method: str) -> str:
    """What ``method`` is, in the words of the eviction tab's ``role`` column: the headline, the expensive
    reference, another learned method, the visitor's own, or a baseline."""
    from scdviz.evict import bench

    if method == HEADLINE_SCORER:
        return HEADLINE
    if method.startswith("yours:"):
        return YOURS
    if method.startswith(bench.LOOKAHEAD):
        return REFERENCE
    return LEARNED_OTHER if method.startswith(bench.LEARNED) else BASELINE


@functools.cache
def benchmark(keep: str) -> dict | None:
    """The headline against ObservedAttention at kept fraction ``keep`` ("0.25") in the shipped record the README
    and docs/results.md cite for it (the first of ``report.HEADLINE_PROTOCOL`` that holds both): the ratio of mean
    KLs with its paired-bootstrap 95% interval (the bench's, as the docs print it), the share of contexts where
    the headline's KL is lower, how many contexts from how many domains, the record; None without one."""
    from scdviz import report

    for rel in report.HEADLINE_PROTOCOL:
        record = report.shipped_record(rel)
        rows = {r["method"]: r for r in record.rows if r.get("mode", "agnostic") == "agnostic"
                and str(r.get("keep")) == keep and "kl_per_context" in r}
        if HEADLINE_SCORER in rows and H2O in rows:
            ours, theirs = rows[HEADLINE_SCORER]["kl_per_context"], rows[H2O]["kl_per_context"]
            boot = report.paired_bootstrap(theirs, ours, report.passages_of(rows[HEADLINE_SCORER]))
            corpora = (record.settings.get("eval") or {}).get("corpora") or []
            return {"ratio": boot["ratio"], "ci": boot["ratio_ci"], "n": len(ours), "domains": len(corpora),
                    "wins": sum(a < b for a, b in zip(ours, theirs, strict=True)) / len(ours),
                    "keep": float(keep), "slice": report.slice_of(record), "model": rows[H2O].get("model"),
                    "record": report.shown_path(settings.ASSETS_DIR / rel)}
    return None


def benchmark_note(kls: dict[str, float], kept: float) -> str:
    """When on this one context the headline's KL is above ObservedAttention's (both ran), a sentence saying that
    one context is noisy and what the shipped benchmark says over its many contexts, at its kept fraction nearest
    ``kept`` (a fraction of the context), with the docs section; else ""."""
    from scdviz import report

    mine, theirs = kls.get(HEADLINE_SCORER), kls.get(H2O)
    if mine is None or theirs is None or not mine > theirs or not 0 < kept:  # NaN: no note
        return ""
    keep = min(report.KEEPS, key=lambda k: abs(math.log(float(k) / kept)))
    b = benchmark(keep)
    if b is None:
        return ""
    at = f"{100 * b['keep']:g} % kept" + ("" if math.isclose(b["keep"], kept, rel_tol=0.02) else
                                          " (its budget nearest this one)")
    where = ", ".join(w for w in (f"{b['domains']} domains" if b["domains"] else "",
                                  f"{b['slice']} slice" if b["slice"] else "", b["model"] or "") if w)
    lo, hi = b["ci"]
    verdict = ("its interval crosses 1: over many contexts neither is clearly better" if lo <= 1 <= hi else
               f"{HEADLINE_SCORER} clearly lower" if hi < 1 else f"{H2O} clearly lower")
    return (f" On this one context {HEADLINE_SCORER} (the headline) scores worse than {H2O} (KL {mine:.4g} vs "
            f"{theirs:.4g}), but one context is noisy: over {b['n']} contexts ({where}) the shipped benchmark gives "
            f"{HEADLINE_SCORER} {b['ratio']:.2f}× {H2O}'s mean KL [95% CI {lo:.2f}, {hi:.2f}] at {at} ({verdict}), "
            f"and {HEADLINE_SCORER} the lower on {b['wins']:.0%} of those contexts (record `{b['record']}`; see "
            f"{BENCH_DOCS}).")


def hosted_cost(tokenizer, request: EvictRequest) -> None:
    """Hosted mode's per-request cost caps, checked in the server's process before any GPU call: at most
    ``settings.hosted_methods()`` methods compared and ``settings.hosted_context_tokens()`` context and question
    tokens (UserError naming the cap); nothing outside hosted mode."""
    if not settings.hosted():
        return
    req = request.checked()
    methods = req.methods if req.methods else []
    if len(methods) > settings.hosted_methods():
        raise UserError(f"this hosted demo compares at most {settings.hosted_methods()} eviction methods per request "
                        f"(SCDVIZ_HOSTED_METHODS) and {len(methods)} are ticked; untick some (a local install runs "
                        "them all)")
    question = QUESTION.format(req.question.strip()) if req.question.strip() else ""
    n = len(tokenizer(req.context + question, add_special_tokens=False)["input_ids"])
    if n > settings.hosted_context_tokens():
        raise UserError(f"context and question have {n} tokens together; this hosted demo evicts from at most "
                        f"{settings.hosted_context_tokens()} (SCDVIZ_HOSTED_CONTEXT_TOKENS; a local install takes "
                        f"{settings.max_prompt_tokens()})")


def evict_run(pair: Pair, request: EvictRequest, policies: dict | None = None, progress=False) -> dict:
    """The chosen eviction methods on one context: retained-token views, texts, the table and what the figures
    are drawn from (``figures``), all picklable and on the host, no figure (a GPU call's result,
    ``scdviz.app.gpu``). ``policies``: the visitor's own policies and scorers by method name (loaded);
    progress: a reporter (``scdviz.progress``) told each phase and method."""
    from scdviz import plots
    from scdviz.evict import bench
    from scdviz.evict.view import eviction_view

    req = request.checked()
    context, question, aware, unit, budget, which, method = (req.context, req.question, req.question_aware,
                                                             req.budget_unit, req.budget, req.model, req.method)
    question = QUESTION.format(question.strip()) if question.strip() else ""
    if len(context) + len(question) > settings.max_prompt_chars():
        raise UserError(f"context and question have {len(context) + len(question):,} characters together; this app "
                        f"accepts at most {settings.max_prompt_chars():,} (SCDVIZ_MAX_PROMPT_CHARS)")
    n_ctx = len(pair.tokenizer(context, add_special_tokens=False)["input_ids"])
    n_q = len(pair.tokenizer(question, add_special_tokens=False)["input_ids"]) if question.strip() else 0
    if n_ctx + n_q > settings.max_prompt_tokens():
        raise UserError(f"context and question have {n_ctx + n_q} tokens together; this app accepts at most "
                        f"{settings.max_prompt_tokens()} (SCDVIZ_MAX_PROMPT_TOKENS)")
    if unit == "% kept":
        budget = inputs.number(budget, "Budget (% kept)", 0, 100)
        if not 0 < budget < 100:
            raise UserError(f"Budget (% kept) must be strictly between 0 and 100, got {budget:g}")
        keep: float | int = budget / 100
    else:
        keep = inputs.integer(budget, "Budget (tokens kept)", 1, settings.max_prompt_tokens())
    model = pair.producer if which == "producer" else pair.consumer
    mine = dict(policies or {})
    inspectable = [m for m in req.methods if m not in bench.native_baselines()] + list(mine)
    method = method.strip() if isinstance(method, str) and method.strip() else inspectable[0] if inspectable else ""
    if method not in inspectable:
        raise UserError(f"Method to inspect: {method[:60]!r} is not among the methods compared whose kept tokens can "
                        f"be shown; choose one of {', '.join(inspectable) or '(none: add a policy or scorer)'}")
    view = eviction_view(model, pair.tokenizer, context, question, keep, aware, policies=mine,
                         lengths=(req.continuation_tokens, req.generated_tokens), methods=req.methods,
                         progress=progress)
    instead = ""
    if method not in view.kept_fraction:  # it could not run on this model (a shipped scorer fitted to another
        # model's widths, say: view.failed says why): inspect the first compared method that ran, and say so
        ran = [m for m in inspectable if m in view.kept_fraction] or sorted(view.kept_fraction)
        instead = (f"{method} could not run on this model (why: at the end), so its kept tokens are not shown; "
                   f"inspecting {ran[0]} instead. ")
        method = ran[0]
    kept = list(zip(view.context_tokens, view.kept_fraction[method]))
    import pandas as pd

    kls = {row["method"]: row["kl"] for row in view.rows}
    learned = {m for m in kls if m.startswith(bench.LEARNED)}
    drawn = {"kl_steps": view.kl_steps, "sweep": view.sweep, "kept_per_layer": view.kept_per_layer[method],
             "tokens": view.context_tokens, "method": method, "features": view.features,
             "kept_fraction": view.kept_fraction[method], "feature_names": view.feature_names,
             "focus": [method, plots.best_other(kls, learned | {method})]}
    info = instead + (f"{method}: keeps {view.tokens_kept} of {len(view.context_tokens)} context tokens {view.counted} "
                      f"({view.budget_label}); {which} model. Full-cache continuation: "
                      f"“{view.continuation.strip()}”")
    info += benchmark_note(kls, view.tokens_kept / max(1, len(view.context_tokens)))
    if view.failed:
        info += " Could not run here: " + "; ".join(f"{m} ({why})" for m, why in view.failed.items()) + "."
    texts = [[m, g] for m, g in view.generations.items()]
    diff = view.versus_h2o[method]
    scale = max((abs(v) for v in diff), default=0.0) or 1.0  # the largest difference darkest: they are small
    versus = list(zip(view.context_tokens, [round(v / scale, 3) for v in diff]))
    table = pd.DataFrame([{"method": r["method"], "role": role(r["method"])} | r for r in view.rows])  # role 2nd
    return {"info": info, "kept": kept, "versus": versus, "table": table, "texts": texts,
            "methods": sorted(view.kept_fraction), "method": method, "figures": drawn}


def evict_figures(drawn: dict) -> dict:
    """The eviction tab's figures from what ``evict_run`` returned under ``figures`` (built where the page is
    served, never in a GPU call): the inspected method and the best baseline strong, the rest faint."""
    from scdviz import plots

    figures = {
        "kl_steps": plots.kl_per_step(drawn["kl_steps"]), "sweep": plots.budget_sweep(drawn["sweep"]),
        "heatmap": plots.kept_heatmap(drawn["kept_per_layer"], drawn["tokens"], drawn["method"]),
        "features": plots.feature_distributions(drawn["features"], drawn["kept_fraction"], drawn["feature_names"]),
    }
    for name in ("kl_steps", "sweep"):
        plots.paint(figures[name], set(drawn["focus"]))
    return figures

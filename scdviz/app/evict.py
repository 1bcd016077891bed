"""The DistillCache tab's work: every eviction method on one context (``EvictRequest``)."""

from __future__ import annotations

from scdviz import settings
from scdviz.app import inputs
from scdviz.app.inputs import UserError
from scdviz.app.requests import EvictRequest
from scdviz.app.session import Session
from scdviz.models.pair import Pair

QUESTION = "\n\nQuestion: {}\nAnswer:"  # how a question follows the context (a base-model prompt, no chat tokens)


def evict_run(pair: Pair, request: EvictRequest, session: Session | None = None, progress=False) -> dict:
    """The chosen eviction methods on one context, with retained-token views, texts and figures.
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
    mine = session.policies if session else {}
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

    figures = {
        "kl_steps": plots.kl_per_step(view.kl_steps), "sweep": plots.budget_sweep(view.sweep),
        "heatmap": plots.kept_heatmap(view.kept_per_layer[method], view.context_tokens, method),
        "features": plots.feature_distributions(view.features, view.kept_fraction[method], view.feature_names),
    }
    kls = {row["method"]: row["kl"] for row in view.rows}
    learned = {m for m in kls if m.startswith(bench.LEARNED)}
    focus = {method, plots.best_other(kls, learned | {method})}
    for name in ("kl_steps", "sweep"):  # the inspected method and the best baseline strong, the rest faint
        plots.paint(figures[name], focus)
    info = instead + (f"{method}: keeps {view.tokens_kept} of {len(view.context_tokens)} context tokens {view.counted} "
                      f"({view.budget_label}); {which} model. Full-cache continuation: "
                      f"“{view.continuation.strip()}”")
    if view.failed:
        info += " Could not run here: " + "; ".join(f"{m} ({why})" for m, why in view.failed.items()) + "."
    texts = [[m, g] for m, g in view.generations.items()]
    diff = view.versus_h2o[method]
    scale = max((abs(v) for v in diff), default=0.0) or 1.0  # the largest difference darkest: they are small
    versus = list(zip(view.context_tokens, [round(v / scale, 3) for v in diff]))
    return {"info": info, "kept": kept, "versus": versus, "table": pd.DataFrame(view.rows), "texts": texts,
            "methods": sorted(view.kept_fraction), "method": method, "figures": figures}

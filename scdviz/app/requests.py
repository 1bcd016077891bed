"""One request dataclass per tab: every control declared once, on its field.

A field's ``control(default, label, kind, ...)`` says how the control shows (label, widget,
limits, row) and how its value is checked (``inputs.Control.check``). The tab builds its
widgets from the fields (``scdviz.app.ui.controls``), its handler receives the values by
field name and builds the request by keyword, and the tab's work (``scdviz.app.scd``, ...)
takes the request and calls ``checked()`` before work starts. Adding a control is one field
here (plus the code that uses its value). Over the API the endpoint's parameters are these
field names, in this order. This module imports neither torch nor gradio.
"""

from __future__ import annotations

from dataclasses import dataclass

from scdviz import settings
from scdviz.app.inputs import Request, control


def _corpora() -> list[str]:
    from scdviz import data  # torch: only when the choices are read

    return data.corpora()


def _evict_methods() -> list[str]:
    from scdviz.evict import bench  # torch and kvpress: only when the choices are read

    return bench.method_names()


def _evict_focus() -> list[str]:
    from scdviz.evict import bench

    return bench.focus_methods()


OFFERED_BITS = (4, 8, 16)  # the code precisions the SCD controls offer (calibration and transfer)
BITS_SHOWN = tuple((str(b), str(b)) for b in OFFERED_BITS)  # as the radio sends them (API clients: the strings)
PLACEMENTS = ("selected", "drift", "manual")
CODERS = (("transform coding: one step per section, entropy coded", "transform"),
          ("rate-distortion plan: ranks, bits and patches", "rd"))
EVICT_UNITS = ("% kept", "tokens kept")
# the shipped distilled scorer (the headline), the method inspected by default: the focus set's cheap pick
# (bench.cheap_on_validation, kept equal by tests/test_app_requests.py; named here so that building a request reads
# no policy file)
HEADLINE_SCORER = "distilled-scorer"
EVICT_MODELS = ("producer", "consumer")
RECALL_TARGETS = (("the oracle's distribution (KL)", "oracle"),  # scdviz.scd.distil.RECALL_TARGETS, labelled
                  ("the quote itself (NLL less the oracle's)", "quote"))


@dataclass
class GenerateRequest(Request):
    """Pair tab: greedy continuations of one prompt by producer and consumer."""

    prompt: str = control("", "Prompt", "text", name="the prompt", hi=settings.max_prompt_chars,
                          props={"lines": 4, "elem_id": "pair-prompt"})
    new_tokens: int = control(32, "New tokens", "int", lo=1, hi=settings.max_new_tokens, step=1, row="generate")
    chat: bool = control(False, "Wrap in the chat template", "flag", name="Chat template", row="generate")


@dataclass
class ScdRequest(Request):
    """SCD tab: one text through every transfer method, with the plan's controls."""

    text: str = control("", "Text (prompt + continuation)", "text", name="the text", hi=settings.max_prompt_chars,
                        props={"lines": 5, "elem_id": "scd-text"})
    continuation_tokens: int = control(32, "Continuation tokens scored", "int", lo=8, hi=64, step=8, row="score")
    generated_tokens: int = control(24, "Tokens generated per method", "int", lo=4, hi=48, step=4, row="score")
    bits: int = control(4, "Code precision (bits)", "choice", choices=BITS_SHOWN, row="score")
    rank_k: int = control(0, "r_K (0 = operating point)", "int", name="r_K", lo=0, hi=192, step=8, row="plan")
    rank_v: int = control(0, "r_V (0 = operating point)", "int", name="r_V", lo=0, hi=192, step=8, row="plan")
    patch_layers: int = control(2, "Patch layers k", "int", lo=0, hi=8, step=1, row="plan")
    placement: str = control("selected", "Placement", "choice", choices=PLACEMENTS, row="plan")
    manual_layers: str = control("", "Manual patch layers (e.g. 14, 18)", "text", name="Manual patch layers", hi=200,
                                 required=False, row="plan")
    bandwidth_gbps: float = control(10.0, "Link bandwidth (Gbit/s)", "number", lo=0.5, hi=100, widget="slider",
                                    row="link")
    latency_ms: float = control(0.5, "Link latency (ms)", "number", lo=0, hi=20, step=0.5, widget="slider", row="link")
    fan_out: bool = control(False, "All built-in specialists (one table)", "flag", name="All built-in specialists",
                            row="link")
    byte_budget: float = control(0.0, "Byte budget, B/token (0 = the controls; else the budget coder decides)",
                                 "number", name="Byte budget (B/token)", lo=0, hi=100_000, widget="number",
                                 row="budget", props={"elem_id": "scd-budget"})
    coder: str = control("transform", "Budget coder", "choice", choices=CODERS, row="budget",
                         props={"elem_id": "scd-coder"})
    recompute_tail: int = control(0, "Recompute the last N prompt tokens (0 = none: adds raw KV and SCD reuse-only "
                                  "with them recomputed by the consumer)", "int", name="Recomputed tail", lo=0,
                                  hi=512, step=8, row="budget", props={"elem_id": "scd-tail"})
    ask: bool = control(True, "Ask the consumer's question about the text (its fine-tuning task, else to continue a "
                        "quote): each method's answer and its task F1", "flag", name="Ask its question", row="score",
                        props={"elem_id": "scd-ask"})


@dataclass
class EvictRequest(Request):
    """DistillCache tab: one context pruned by every eviction method."""

    context: str = control("", "Context", "text", name="the context", hi=settings.max_prompt_chars,
                           props={"lines": 5, "elem_id": "ev-context"})
    question: str = control("", "Question (optional)", "text", name="the question", hi=settings.max_prompt_chars,
                            required=False, row="question", props={"elem_id": "ev-question"})
    question_aware: bool = control(False, "Question-aware (compress context + question)", "flag",
                                   name="Question-aware", row="question")
    budget_unit: str = control("% kept", "Budget unit", "choice", choices=EVICT_UNITS, row="budget")
    # its range depends on the unit: checked by scdviz.app.evict
    budget: float = control(25, "Budget", "number", widget="number", row="budget", props={"elem_id": "ev-budget"})
    model: str = control("producer", "Model", "choice", choices=EVICT_MODELS, row="budget")
    method: str = control(HEADLINE_SCORER, "Method to inspect (its kept tokens)", "pick",
                          name="Method to inspect", choices=(HEADLINE_SCORER,), row="budget",
                          props={"elem_id": "ev-show", "scale": 3, "min_width": 400,  # the student's name is long
                                 "info": f"by default {HEADLINE_SCORER}, the headline"})
    # None: the focused set (bench.focus_methods); the full cache is always the reference
    methods: list = control(None, "Methods compared (each against the full cache; your own policies always run)",
                            "choices", name="Methods", choices=_evict_methods, initial=_evict_focus,
                            props={"elem_id": "ev-methods", "info": (
                                f"{HEADLINE_SCORER} is the headline (the shipped distilled scorer: cheap at a prefill "
                                "and while decoding). lookahead-policy is an expensive reference, not a rival: it "
                                "samples continuations of the context at every prefill, compute no other method "
                                "spends, and cannot run while decoding. DistillCache and DistillCache-per-head are "
                                "the learned method as designed. The rest are kvpress's baselines, ObservedAttention "
                                "(H2O's accumulated-attention score) among them.")})
    continuation_tokens: int = control(24, "Continuation tokens scored", "int", lo=8, hi=64, step=8, row="lengths")
    generated_tokens: int = control(16, "Tokens generated per method", "int", lo=4, hi=48, step=4, row="lengths")


@dataclass
class CalibrateRequest(Request):
    """Calibrate / train tab: an SCD calibration of the loaded pair, saved as a run."""

    domains: list = control(None, "Calibration domains", "choices", choices=_corpora, row="calibrate", hosted=1,
                            props={"elem_id": "cal-domains"})
    fit_windows: int = control(16, "Windows for the fits", "int", lo=4, hi=64, step=4, row="calibrate", hosted=4)
    select_windows: int = control(4, "Windows for patch selection", "int", lo=1, hi=16, step=1, row="calibrate",
                                  hosted=1)
    rate_windows: int = control(4, "Windows for the rate curves (0: none; the byte-budget coder needs them)", "int",
                                name="Windows for the rate curves", lo=0, hi=16, step=1, row="calibrate", hosted=0)
    patch_layers: int = control(2, "Patch layers at the operating point", "int", lo=0, hi=6, step=1, row="calibrate")
    bits: int = control(4, "Code bits", "choice", choices=BITS_SHOWN, row="calibrate")
    name: str = control("my-calibration", "Save as", "text", hi=200, required=False, row="calibrate")


@dataclass
class DistilRequest(Request):
    """Calibrate / train tab: the correction stage of the visitor's SCD calibration (else the shipped one)
    trained through the consumer on its continuation KL (scdviz.scd.distil), saved as a new calibration run."""

    train_windows: int = control(2, "Training windows per domain (train split)", "int", lo=1, hi=300, step=1,
                                 row="distil", hosted=2)
    val_windows: int = control(1, "Validation windows per domain (calib split; they choose what is kept)", "int", lo=1,
                               hi=8, step=1, row="distil", hosted=1)
    epochs: int = control(2, "Epochs", "int", lo=1, hi=6, step=1, row="distil", hosted=2)
    val_every: int = control(0, "Validate every N training steps (0: after each epoch)", "int", lo=0, hi=1800,
                             step=10, row="distil", hosted=0)
    rank: int = control(32, "Correction rank", "int", lo=4, hi=64, step=4, row="distil")
    recall: float = control(0.1, "Share of windows that quote their own prompt (a quote-recall term)", "number",
                            lo=0, hi=0.5, step=0.05, widget="slider", row="distil-recall")
    recall_target: str = control("quote", "Quoted tokens scored by", "choice", choices=RECALL_TARGETS,
                                 row="distil-recall")
    budgets: bool = control(True, "Also at 1/6 and 1/10 of fp16 (transform coded; needs the rate curves)", "flag",
                            name="Also at 1/6 and 1/10 of fp16", row="distil-more")
    name: str = control("my-distilled", "Save the trained calibration as", "text", hi=200, required=False,
                        row="distil-more")


@dataclass
class FitRequest(Request):
    """Calibrate / train tab: the headline eviction method, the distilled scorer, fitted on the producer and saved
    as a run (``python -m scdviz fit-student`` with the sizes a live session can afford)."""

    contexts: int = control(12, "Training contexts", "int", lo=6, hi=60, step=6, row="fit", hosted=6)
    val_contexts: int = control(6, "Validation contexts", "int", lo=6, hi=24, step=6, row="fit", hosted=6)
    window: int = control(32, "Window (recent queries read; 0: none)", "int", lo=0, hi=64, step=8, row="fit")
    name: str = control("my-scorer", "Save scorer as", "text", hi=200, required=False, row="fit")


@dataclass
class TrainRequest(Request):
    """Calibrate / train tab: a DistillCache policy (REINFORCE, docs/design.md#training) trained on the producer,
    saved as a run."""

    steps: int = control(20, "REINFORCE steps", "int", lo=5, hi=300, step=5, row="train", hosted=10)
    contexts: int = control(4, "Training contexts", "int", lo=2, hi=32, step=2, row="train", hosted=2)
    per_head: bool = control(True, "Per layer and KV head (else one token set, as specified)", "flag",
                             name="Per layer and KV head", row="train")
    name: str = control("my-policy", "Save as", "text", hi=200, required=False, row="train")

"""Widgets built from a request dataclass (``scdviz.app.requests``), one per field, in field order.

``build`` makes each field's widget from its ``Control`` (label, kind, limits, default, row);
the tab wires them with ``inputs_kwargs=widgets``, so its handler receives the values by field
name (``**values``) and builds the request by keyword, and the API's parameters are the field
names. Adding a control is one field in the dataclass; nothing here changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import MISSING, fields

import gradio as gr

from scdviz.app.inputs import Control

from gradio.events import Dependency

class WholeSlider(gr.Slider):
    """A slider of whole numbers: typed ``int`` in the API (precision 0), yet a fraction an API client
    sends is not rounded away: it reaches the request's check, which refuses it by name."""

    is_template = True  # the browser draws it as a plain slider

    def preprocess(self, payload: float) -> float:
        gr.Number.raise_if_out_of_bounds(payload, self.minimum, self.maximum)
        return payload
    from typing import Callable, Literal, Sequence, Any, TYPE_CHECKING
    from gradio.blocks import Block
    if TYPE_CHECKING:
        from gradio.components import Timer
        from gradio.components.base import Component


def widget(c: Control, value) -> gr.components.Component:
    """The widget of one control, showing ``value``."""
    lo, hi = c.limits()
    props = dict(c.props)
    shown = c.choices() if callable(c.choices) else list(c.choices)
    kind = c.widget or {"text": "textbox", "int": "slider", "number": "slider" if hi is not None else "number",
                        "choice": "radio", "choices": "dropdown", "flag": "checkbox", "pick": "dropdown"}[c.kind]
    if c.kind in ("int", "number") and value is not None and lo is not None and hi is not None:
        value = min(max(value, lo), hi)  # a default beyond a limit read from the settings
    if kind == "textbox":
        return gr.Textbox(label=c.label, value=value, max_length=hi, **props)
    if kind == "slider" and lo >= hi:  # a hosted cap at the floor: one value, shown and not offered
        info = f"fixed at {hi:g} in this hosted demo (a local install offers more)"
        return gr.Number(value=hi, minimum=lo, maximum=hi, precision=0 if c.kind == "int" else None, label=c.label,
                         interactive=False, **{**props, "info": info})
    if kind == "slider":
        if c.kind == "int":
            return WholeSlider(lo, hi, value=value, step=c.step or 1, precision=0, label=c.label, **props)
        return gr.Slider(lo, hi, value=value, step=c.step, label=c.label, **props)
    if kind == "number":
        return gr.Number(value=value, minimum=lo, maximum=hi, precision=0 if c.kind == "int" else None,
                         label=c.label, **props)
    if kind == "checkbox":
        return gr.Checkbox(value=value, label=c.label, **props)
    if kind == "radio":
        if value is not None and all(isinstance(o, str) for o in c.options()):
            value = str(value)  # e.g. code bits: the radio holds "4", the request the number
        return gr.Radio(shown, value=value, label=c.label, **props)
    if c.kind == "choices":
        if value is None:
            value = c.default_choices()
        return gr.Dropdown(shown, value=value, multiselect=True, label=c.label, **props)
    return gr.Dropdown(shown, value=value, label=c.label, allow_custom_value=c.kind == "pick", **props)


def build(request_type: type, values: dict | None = None, after: dict[str, Callable] | None = None
          ) -> dict[str, gr.components.Component]:
    """Field name -> widget for every control of ``request_type``, in field order.

    Consecutive fields of the same ``row`` sit in one ``gr.Row``. ``values`` overrides defaults
    (e.g. the first example text); ``after[name](widget)`` runs right after that field's widget is
    made, inside its row (a button, examples)."""
    values, after = values or {}, after or {}
    out: dict[str, gr.components.Component] = {}
    fs = [f for f in fields(request_type) if "control" in f.metadata]
    i = 0
    while i < len(fs):
        row = fs[i].metadata["control"].row
        group = [fs[i]]
        while row and i + len(group) < len(fs) and fs[i + len(group)].metadata["control"].row == row:
            group.append(fs[i + len(group)])
        with gr.Row() if row else contextlib.nullcontext():
            for f in group:
                default = f.default if f.default is not MISSING else None
                out[f.name] = widget(f.metadata["control"], values.get(f.name, default))
                if f.name in after:
                    after[f.name](out[f.name])
        i += len(group)
    return out


def build_run(request_type: type, text_field: str, examples: list[str], examples_label: str, button_after: str,
              button: dict) -> tuple[dict[str, gr.components.Component], gr.Button]:
    """A run tab's controls (``build``): the first example in ``text_field`` with the examples under it,
    and the run button (``gr.Button(**button)``) right after the ``button_after`` field. Returns
    (field name -> widget, the button)."""
    made = {}

    def add_examples(text):
        if examples:
            gr.Examples([[e] for e in examples], inputs=[text], label=examples_label)

    def add_button(_):
        made["button"] = gr.Button(variant="primary", **button)

    widgets = build(request_type, {text_field: examples[0] if examples else ""},
                    after={text_field: add_examples, button_after: add_button})
    return widgets, made["button"]

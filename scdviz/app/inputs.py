"""Checks on what a person (or an API client) sends, done before any work starts.

Every check raises ``UserError`` whose message names the field, what was wrong and the
accepted range, so the UI and the CLI can show it as it is. Values arrive as the UI sends
them (numbers may be None when a box was cleared, strings over the API, ``inf``), so each
check converts as well as bounds. ``Control`` declares a tab's control once, on its request
field: the same declaration builds the widget and checks the value. This module imports
neither torch nor gradio.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from scdviz.errors import UserError

__all__ = ["UserError", "number", "integer", "choice", "choices", "flag", "text", "unicode_text", "Control", "control",
           "Request"]


def number(value, field: str, lo: float, hi: float) -> float:
    """A finite number in [lo, hi]."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise UserError(f"{field} is empty; enter a number between {lo:g} and {hi:g}")
    if isinstance(value, bool):
        raise UserError(f"{field} must be a number between {lo:g} and {hi:g}, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{field} must be a number between {lo:g} and {hi:g}, got {_short(value)}") from None
    if not math.isfinite(x) or not lo <= x <= hi:
        raise UserError(f"{field} must be between {lo:g} and {hi:g}, got {_short(value)}")
    return x


def integer(value, field: str, lo: int, hi: int) -> int:
    """A whole number in [lo, hi] (``3.0`` is accepted, ``3.5`` is not)."""
    x = number(value, field, lo, hi)
    if x != int(x):
        raise UserError(f"{field} must be a whole number between {lo} and {hi}, got {_short(value)}")
    return int(x)


def choice(value, field: str, options) -> str:
    """One of ``options`` (compared as strings)."""
    options = [str(o) for o in options]
    if str(value) not in options:
        raise UserError(f"{field} must be one of {', '.join(options)}; got {_short(value)}")
    return str(value)


def choices(values, field: str, options, at_least: int = 1) -> list[str]:
    """Several of ``options`` (a list, or one string), at least ``at_least``, without repeats."""
    values = [values] if isinstance(values, str) else list(values or [])
    if len(values) < at_least:
        raise UserError(f"{field}: choose at least {at_least}")
    return list(dict.fromkeys(choice(v, field, options) for v in values))


def flag(value, field: str) -> bool:
    """A checkbox value: True/False (also 0/1 and 'true'/'false' from API clients)."""
    if isinstance(value, bool):
        return value
    if value in (0, 1) or str(value).lower() in ("true", "false", "0", "1"):
        return str(value).lower() in ("1", "true")
    raise UserError(f"{field} must be true or false, got {_short(value)}")


def text(value, field: str, max_chars: int, required: bool = True, setting: str | None = "SCDVIZ_MAX_PROMPT_CHARS"
         ) -> str:
    """A string of at most ``max_chars`` characters of valid Unicode (checked before anything tokenises it);
    ``setting`` names the environment variable the limit comes from, if one does."""
    if value is None:
        value = ""
    if not isinstance(value, str):
        raise UserError(f"{field} must be text, got {type(value).__name__}")
    if len(value) > max_chars:
        raise UserError(f"{field} has {len(value):,} characters; this app accepts at most {max_chars:,}"
                        + (f" ({setting})" if setting else ""))
    unicode_text(value, field)
    if required and not value.strip():
        raise UserError(f"{field} is empty")
    return value


def unicode_text(value: str, field: str) -> str:
    """``value`` if it is valid Unicode text; a lone surrogate (which JSON can carry, and no tokenizer or
    file name accepts) is refused by position."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UserError(f"{field} holds a character that is not valid Unicode text (an unpaired surrogate, "
                        f"{value[err.start]!r}, at position {err.start:,}); remove it") from None
    return value


def _short(value, n: int = 40) -> str:
    text_ = repr(value)
    return text_ if len(text_) <= n else text_[: n - 3] + "..."


# ----------------------------------------------------------------------------- controls declared on request fields

KINDS = ("text", "int", "number", "choice", "choices", "flag", "pick")


@dataclass(frozen=True)
class Control:
    """One control of a tab, declared once on its request field (``control(...)``): the widget the
    UI builds (``scdviz.app.ui.controls``) and the check its value passes before work starts.

    Kinds: ``text`` (at most ``hi`` characters), ``int`` / ``number`` in [lo, hi] (a number without
    limits is checked by the service: its range depends on another field), ``choice`` (one of
    ``choices``), ``choices`` (several), ``flag`` (true/false) and ``pick`` (a free choice: any text,
    resolved by the service). Limits and choices may be callables, read when used (settings).
    """

    label: str  # the widget's label
    kind: str  # one of KINDS
    lo: float | Callable | None = None  # lower limit (int, number)
    hi: float | Callable | None = None  # upper limit (int, number), most characters (text)
    step: float | None = None  # a slider's step
    choices: tuple | Callable = ()  # values, or (shown label, value) pairs
    name: str = ""  # how messages name the field (default: the label)
    required: bool = True  # text: an empty one is refused
    widget: str = ""  # "slider", "number", "radio", "dropdown", "textbox", "checkbox" (default: by kind)
    row: str = ""  # consecutive fields of one row sit side by side
    props: tuple = ()  # more widget arguments as (key, value) pairs (elem_id, lines, ...)
    initial: Callable | None = None  # choices: what a default of None means (read when used); else all of them
    # hosted mode's cap (``settings.hosted()``): an int's or number's highest value, or how many of ``choices`` one
    # request may tick. Set on the sizes of the heavy jobs, so that each ends within a minute on a 2-core CPU
    # (``python -m research.hosted_load --heavy``) and within a ZeroGPU visitor's daily minutes on a Space.
    hosted: float | Callable | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown control kind {self.kind!r}; use one of {', '.join(KINDS)}")

    @property
    def title(self) -> str:
        return self.name or self.label

    def limits(self) -> tuple:
        """(lo, hi), callables read now; an int's or number's ``hi`` is the hosted cap in hosted mode."""
        lo, hi = (v() if callable(v) else v for v in (self.lo, self.hi))
        cap = self.cap()
        return lo, hi if cap is None or self.kind not in ("int", "number") else min(hi, cap)

    def cap(self):
        """The hosted cap in force (None: none, or not hosted)."""
        from scdviz import settings

        if self.hosted is None or not settings.hosted():
            return None
        return self.hosted() if callable(self.hosted) else self.hosted

    def default_choices(self) -> list:
        """What a ``choices`` default of None means: ``initial()``, else every option; in hosted mode the first
        ``cap()`` of them."""
        found = self.initial() if self.initial is not None else self.options()
        cap = self.cap()
        return list(found) if cap is None else list(found)[: int(cap)]

    def options(self) -> list:
        """The accepted values (the second of each (shown label, value) pair)."""
        found = self.choices() if callable(self.choices) else self.choices
        return [c[1] if isinstance(c, tuple) else c for c in found]

    def check(self, value):
        """The value converted and bounded, or UserError naming the field, what was wrong and what is accepted."""
        value = self._within_limits(value)
        cap = self.cap()
        if cap is not None and self.kind == "choices" and len(value) > cap:
            raise UserError(f"this hosted demo takes at most {cap:g} {self.title} per request and {len(value)} are "
                            "chosen; choose fewer (a local install takes them all)")
        return value

    def _within_limits(self, value):
        lo, hi = self.limits()
        cap = self.cap()
        if cap is not None and self.kind in ("int", "number"):
            full = self.hi() if callable(self.hi) else self.hi
            try:
                over = float(value) > cap and float(value) <= full
            except (TypeError, ValueError):
                over = False
            if over:
                raise UserError(f"this hosted demo takes {self.title} up to {cap:g}, got {_short(value)}; lower it "
                                f"(a local install takes up to {full:g})")
        if self.kind == "text":  # a limit read from the settings names its environment variable
            return text(value, self.title, hi, self.required, "SCDVIZ_MAX_PROMPT_CHARS" if callable(self.hi) else None)
        if self.kind == "int":
            return integer(value, self.title, lo, hi)
        if self.kind == "number":
            return value if lo is None or hi is None else number(value, self.title, lo, hi)
        if self.kind == "flag":
            return flag(value, self.title)
        if self.kind == "choices":
            return choices(self.default_choices() if value is None else value, self.title, self.options())
        if self.kind == "pick":
            return value if isinstance(value, str) else None
        opts = self.options()
        numeric = [int(o) for o in opts if isinstance(o, int) or (isinstance(o, str) and o.isdigit())]
        if opts and len(numeric) == len(opts):  # e.g. code bits, sent as "4" (or 4, 4.0): the number 4
            return int(choice(integer(value, self.title, min(numeric), max(numeric)), self.title, numeric))
        picked = choice(value, self.title, opts)
        return next(o for o in opts if str(o) == picked)


def control(default, label: str, kind: str, **how):
    """A request field with its control: ``x: int = control(32, "Tokens", "int", lo=8, hi=64, step=8)``."""
    if "props" in how:
        how["props"] = tuple(dict(how["props"]).items())
    return field(default=default, metadata={"control": Control(label, kind, **how)})


class Request:
    """Base of the request dataclasses (``scdviz.app.requests``): one per tab, one field per control."""

    @classmethod
    def controls(cls) -> dict[str, Control]:
        """Field name -> Control, in field order."""
        return {f.name: f.metadata["control"] for f in fields(cls) if "control" in f.metadata}

    def checked(self):
        """A copy whose every field passed its control's check (UserError at the first that does not)."""
        return replace(self, **{name: c.check(getattr(self, name)) for name, c in self.controls().items()})

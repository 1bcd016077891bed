"""Checks on what a person (or an API client) sends, done before any work starts.

Every check raises ``UserError`` whose message names the field, what was wrong and the
accepted range, so the UI and the CLI can show it as it is. Values arrive as the UI sends
them (numbers may be None when a box was cleared, strings over the API, ``inf``), so each
check converts as well as bounds. This module imports neither torch nor gradio.
"""

from __future__ import annotations

import math

from scdviz.errors import UserError

__all__ = ["UserError", "number", "integer", "choice", "choices", "flag", "text"]


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


def text(value, field: str, max_chars: int, required: bool = True) -> str:
    """A string of at most ``max_chars`` characters (checked before anything tokenises it)."""
    if value is None:
        value = ""
    if not isinstance(value, str):
        raise UserError(f"{field} must be text, got {type(value).__name__}")
    if len(value) > max_chars:
        raise UserError(f"{field} has {len(value):,} characters; this app accepts at most {max_chars:,} "
                        f"(SCDVIZ_MAX_PROMPT_CHARS)")
    if required and not value.strip():
        raise UserError(f"{field} is empty")
    return value


def _short(value, n: int = 40) -> str:
    text_ = repr(value)
    return text_ if len(text_) <= n else text_[: n - 3] + "..."

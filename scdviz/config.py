"""Config dataclasses: one place for every knob's default and help, read by the CLI and artefacts.

A config field is declared with ``opt(default, "help")``. ``add_arguments`` turns a config
dataclass into argparse flags (``--field-name``; lists as space-separated values; booleans
as ``--flag`` / ``--no-flag``; nested configs flattened), ``from_args`` builds the config
back, and ``from_dict`` reads a saved config tolerantly: missing fields take today's
defaults and unknown ones are reported, so an artefact outlives a renamed knob.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import MISSING, field, fields, is_dataclass


def opt(default=MISSING, help: str = "", *, choices=None, required: bool = False, flag: str | None = None):  # noqa: A002
    """A config field with its help text (shown by ``--help``); lists/dicts are copied per instance."""
    meta = {"help": help, "choices": choices, "required": required, "flag": flag}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _unwrap(tp):
    """(base type, is_list, optional) of an annotation."""
    optional = False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional, tp = True, args[0]
        origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return typing.get_args(tp)[0], True, optional
    return tp, False, optional


def add_arguments(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of ``cls`` (nested config dataclasses flattened); help, with the default, on every flag."""
    hints = _hints(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        tp = hints[f.name]
        if is_dataclass(tp):
            add_arguments(parser, tp, skip)
            continue
        meta = f.metadata
        if not meta.get("help"):
            raise TypeError(f"{cls.__name__}.{f.name} has no help text; declare it with opt(default, help)")
        flag = "--" + (meta.get("flag") or f.name.replace("_", "-"))
        base, is_list, _ = _unwrap(tp)
        default = f.default_factory() if f.default_factory is not MISSING else (None if f.default is MISSING else f.default)
        if is_list:
            default = list(default or [])
        shown = "" if default in (None, []) else f" (default: {' '.join(map(str, default)) if is_list else default})"
        kw: dict = {"dest": f.name, "help": meta["help"] + shown, "default": default}
        if meta.get("choices"):
            kw["choices"] = meta["choices"]
        if meta.get("required") or (f.default is MISSING and f.default_factory is MISSING):
            kw["required"] = True
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = base
            kw["metavar"] = base.__name__.upper()
            if is_list:
                kw["nargs"] = "*"
        parser.add_argument(flag, **kw)


def from_args(cls, args: argparse.Namespace):
    """The config ``cls`` from parsed flags (nested configs rebuilt); lists become the field's type."""
    hints = _hints(cls)
    values = {}
    for f in fields(cls):
        tp = hints[f.name]
        if is_dataclass(tp):
            values[f.name] = from_args(tp, args)
        elif hasattr(args, f.name):
            values[f.name] = _coerce(tp, getattr(args, f.name))
    return cls(**values)


def _coerce(tp, value):
    if value is None:
        return None
    _, is_list, _ = _unwrap(tp)
    if is_list:
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            origin = typing.get_origin(next(a for a in typing.get_args(tp) if a is not type(None)))
        return tuple(value) if origin is tuple else list(value)
    return value


def from_dict(cls, saved: dict, where: str = "the saved config") -> tuple:
    """(config, unknown field names) from a saved dict; missing fields take the current defaults.

    ValueError when a value cannot make a valid config (the config's own checks say why).
    """
    if not isinstance(saved, dict):
        raise ValueError(f"{where}: expected a mapping of settings, got {type(saved).__name__}")
    hints = _hints(cls)
    names = {f.name for f in fields(cls)}
    values, unknown = {}, sorted(set(saved) - names)
    for f in fields(cls):
        if f.name not in saved:
            continue
        tp = hints[f.name]
        if is_dataclass(tp):
            values[f.name], inner = from_dict(tp, saved[f.name], where)
            unknown += [f"{f.name}.{u}" for u in inner]
        else:
            values[f.name] = _coerce(tp, saved[f.name])
    try:
        return cls(**values), unknown
    except TypeError as err:
        raise ValueError(f"{where}: {err}") from None


def to_dict(cfg) -> dict:
    """A config as plain JSON-able data (tuples as lists)."""
    return dataclasses.asdict(cfg)

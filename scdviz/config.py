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
import json
import types
import typing
from dataclasses import MISSING, field, fields, is_dataclass


def opt(default=MISSING, help: str = "", *, choices=None, required: bool = False,  # noqa: A002
        flag: str | None = None):
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


def flag_of(f) -> str:
    """The command-line flag of a config field: ``--name-with-dashes``, or the one ``opt(flag=...)`` names."""
    return "--" + (f.metadata.get("flag") or f.name.replace("_", "-"))


def flags(cls) -> dict[str, tuple[str, object]]:
    """{field: (flag, default)} of every flag of ``cls``, nested config dataclasses flattened (as
    ``add_arguments`` makes them)."""
    out: dict[str, tuple[str, object]] = {}
    hints = _hints(cls)
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            out.update(flags(hints[f.name]))
            continue
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        out[f.name] = (flag_of(f), default)
    return out


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
        flag = flag_of(f)
        base, is_list, _ = _unwrap(tp)
        default = (f.default_factory() if f.default_factory is not MISSING
                   else (None if f.default is MISSING else f.default))
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


# ----------------------------------------------------------------------------- config files (TOML)

# where a run writes, not what it measures: left out of a saved config, so a rerun from it makes a new run
OUTPUT_FIELDS = frozenset({"out", "name", "figures", "maintainer", "resume", "work", "spool", "prepare_part"})


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {float("inf"): "inf", float("-inf"): "-inf"}.get(value, "nan" if value != value else repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def to_toml(settings: dict, header: str = "") -> str:
    """Settings (``to_dict`` of a command) as TOML: nested configs as tables, None and output fields left out."""
    lines = [f"# {line}" for line in header.splitlines()]

    def emit(table: dict, prefix: str) -> None:
        nested = {k: v for k, v in table.items() if isinstance(v, dict)}
        for key, value in table.items():
            if key in OUTPUT_FIELDS or isinstance(value, dict):
                continue
            if value is None:
                lines.append(f"# {key}: default (None)")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        for key, value in nested.items():
            lines.extend(["", f"[{prefix}{key}]"])
            emit(value, f"{prefix}{key}.")

    emit(settings, "")
    return "\n".join(lines) + "\n"


def unknown_keys(cls, saved: dict, prefix: str = "") -> list[str]:
    """Keys of ``saved`` that are no field of ``cls`` (nested tables checked against nested configs)."""
    hints = _hints(cls)
    names = {f.name: hints[f.name] for f in fields(cls)}
    out = []
    for key, value in saved.items():
        if key not in names:
            out.append(prefix + key)
        elif is_dataclass(names[key]):
            out += unknown_keys(names[key], value if isinstance(value, dict) else {}, f"{prefix}{key}.")
    return out


def read_toml(cls, path: str) -> dict:
    """A config file for command settings ``cls``, as flat ``{flag dest: value}`` to use as parser
    defaults (flags given on the command line still win). ValueError names unknown keys."""
    import tomllib
    from pathlib import Path

    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"config file not found: {file}")
    try:
        saved = tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file.name} is not a TOML file: {err}") from None
    unknown = unknown_keys(cls, saved)
    if unknown:
        raise ValueError(f"{file.name}: unknown settings {', '.join(unknown)} (see --help for the names)")
    flat = {}

    def walk(klass, table: dict) -> None:
        types_ = _hints(klass)
        for f in fields(klass):
            if f.name in table:
                if is_dataclass(types_[f.name]):
                    walk(types_[f.name], table[f.name])
                else:
                    flat[f.name] = table[f.name]

    walk(cls, saved)
    return flat

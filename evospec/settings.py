"""One settings schema: the typed dataclasses (``TreeConfig``, ``VocabConfig``, ``AdaptConfig``)
are the YAML sections of ``evospec serve`` and the flags of ``generate``, ``bench`` and
``serve``, with one set of names, types, defaults and checks.

Owns: reading a section from a parsed mapping (:func:`section_from_mapping`: unknown keys
and wrong types are refused naming ``<section>.<key>``, then the dataclass's own
``__post_init__`` checks the values), the flag set of a section
(:func:`add_section_flags`: one flag per field, named ``--<prefix><field>`` unless the field's
metadata gives a ``flag``, help from the field's ``help`` metadata, default shown from the
dataclass), and the values given on a command line (:func:`section_from_args`,
:func:`given_flags`). Fields whose metadata says ``internal`` (set by the program, not by a
user: e.g. the adaptation mode, which follows the method) are neither keys nor flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import MISSING, fields
from typing import Any

_NAMES = {int: "int", float: "float", str: "str", bool: "bool", type(None): "null"}


def setting(default: Any, help_text: str, *, flag: str | None = None, internal: bool = False) -> Any:
    """A settings dataclass field: its default, the help its flag shows, an optional flag name
    (default ``--<prefix><field>``), and ``internal`` for fields only the program sets."""
    meta: dict[str, Any] = {"help": help_text, "internal": internal}
    if flag:
        meta["flag"] = flag
    return dataclasses.field(default=default, metadata=meta)


class SettingsError(ValueError):
    """A settings section (file or flags) is invalid; the message names the key."""


def user_fields(cls: type) -> list[dataclasses.Field]:
    """The fields a user may set (``internal`` metadata excluded), in declaration order."""
    return [f for f in fields(cls) if not f.metadata.get("internal")]


def field_types(cls: type) -> dict[str, tuple[type, ...]]:
    """Accepted Python types per user field, from the annotations (a float also takes an int)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[type, ...]] = {}
    for f in user_fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        accepted = tuple(args)
        if float in accepted:
            accepted = (int, *accepted)
        out[f.name] = accepted
    return out


def check_type(name: str, value: Any, accepted: tuple[type, ...]) -> None:
    """SettingsError unless ``value`` is one of ``accepted`` (a bool is not an int)."""
    if (isinstance(value, bool) and bool not in accepted) or not isinstance(value, accepted):
        want = " or ".join(dict.fromkeys(_NAMES[t] for t in accepted if not (t is int and float in accepted)))
        raise SettingsError(f"{name} must be {want}, got {value!r}")


def section_from_mapping(cls: type, raw: Any, section: str, *, base: Any = None) -> Any:
    """``cls`` built from a parsed YAML mapping (missing keys keep ``base``'s values, or the
    defaults). Messages name ``<section>.<key>``; the dataclass checks the values."""
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, dict):
        raise SettingsError(f"{section} must be a mapping of {cls.__name__} settings")
    types_ = field_types(cls)
    unknown = sorted(set(raw) - set(types_))
    if unknown:
        raise SettingsError(f"unknown {section} key(s) {unknown}; known: {sorted(types_)}")
    for key, value in raw.items():
        check_type(f"{section}.{key}", value, types_[key])
    try:
        return dataclasses.replace(base, **raw) if base is not None else cls(**raw)
    except (TypeError, ValueError) as exc:
        raise SettingsError(str(exc)) from None


def _flag(f: dataclasses.Field, prefix: str) -> str:
    return f.metadata.get("flag") or f"--{prefix}{f.name.replace('_', '-')}"


def _dest(f: dataclasses.Field, section: str) -> str:
    return f"{section}__{f.name}"


def add_section_flags(parser: argparse._ActionsContainer, cls: type, section: str, prefix: str = "") -> None:
    """One flag per user field of ``cls`` (default None = not given; help shows the default)."""
    types_ = field_types(cls)
    for f in user_fields(cls):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        accepted = [t for t in types_[f.name] if t is not type(None)]
        kind = float if float in accepted else accepted[0]
        help_text = f"{f.metadata.get('help', f.name)} (default: {default})"
        kw: dict[str, Any] = {"dest": _dest(f, section), "default": None, "help": help_text}
        if kind is bool:
            parser.add_argument(_flag(f, prefix), action=argparse.BooleanOptionalAction, **kw)
        else:
            parser.add_argument(_flag(f, prefix), type=kind, metavar=f.name.upper(), **kw)


def given_flags(args: argparse.Namespace, cls: type, section: str) -> dict[str, Any]:
    """The fields of ``cls`` whose flags were given on the command line."""
    out = {}
    for f in user_fields(cls):
        value = getattr(args, _dest(f, section), None)
        if value is not None:
            out[f.name] = value
    return out


def section_from_args(args: argparse.Namespace, cls: type, section: str, *, base: Any = None) -> Any:
    """``base`` (default: ``cls()``) with the given flags applied and checked."""
    try:
        return dataclasses.replace(base if base is not None else cls(), **given_flags(args, cls, section))
    except (TypeError, ValueError) as exc:
        raise SettingsError(str(exc)) from None

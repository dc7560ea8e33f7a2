"""A setting's value as a YAML user writes it: its type checked against the field's annotation and named in the
user's words (``a number``, ``a list of names``), a lossless conversion of what YAML read, and the closest known
name of a misspelt one."""

from __future__ import annotations

import contextlib
import difflib
import types
import typing

import yaml


@contextlib.contextmanager
def naming(*settings: str):
    """Marks a ``ValueError`` raised inside as one about ``settings`` (its ``settings`` attribute, unless a deeper check
    marked it already): :func:`cppo.config.load_config` then says where they were set without reading the message."""
    try:
        yield
    except ValueError as e:
        if not getattr(e, "settings", None):
            e.settings = settings
        raise


def did_you_mean(name: str, choices) -> str:
    """``" (did you mean 'x'?)"`` for the choice closest to ``name``, or ``""`` when none is close."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def alternatives(hint) -> tuple:
    """``int | None`` -> (int, NoneType); ``list[str]`` -> (list[str],)."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return typing.get_args(hint) if union else (hint,)


def check_type(name: str, value, hint) -> None:
    allowed = alternatives(hint)
    for t in allowed:
        t = typing.get_origin(t) or t
        if t is type(None) and value is None:
            return
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if t is int and isinstance(value, bool):
            continue
        if t is list and isinstance(value, list):
            _check_items(name, value, typing.get_args(alternatives(hint)[0]))
            return
        if isinstance(t, type) and t is not type(None) and isinstance(value, t):
            return
    raise ValueError(f"{name} must be {_type_name(hint)}, got {_shown(value)}")


def _check_items(name: str, value: list, item_types: tuple) -> None:
    """Each item of a ``list[T]`` setting is a ``T`` (``rewards: [format, [digits]]`` names item 2)."""
    for i, item in enumerate(value, start=1):
        if item_types and not isinstance(item, item_types):
            kinds = " or ".join(_TYPE_WORDS.get(t, t.__name__) for t in item_types)
            raise ValueError(f"{name} must be a list of {kinds}s, but item {i} is {_shown(item)}")


#: Type names as a YAML user reads them (no Python reprs in errors).
_TYPE_WORDS = {str: "name", int: "integer", float: "number", bool: "true/false", list: "list", dict: "mapping"}


def _shown(value) -> str:
    """A value as YAML would write it, with its kind: ``abc (text)``, ``[1, 2] (a list)``."""
    kind = {str: "text", bool: "true/false", int: "an integer", float: "a number", list: "a list", dict: "a mapping"}
    text = yaml.safe_dump(value, default_flow_style=True, width=80).strip().removesuffix("...").strip()
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({kind.get(type(value), type(value).__name__)})" if value is not None else "null"


def _type_name(hint) -> str:
    """A setting's type as a YAML user reads it: ``a number``, ``an integer or null``, ``a list of names``."""
    words = {float: "a number", int: "an integer", str: "text", bool: "true or false", dict: "a mapping"}
    parts = []
    for t in alternatives(hint):
        if t is type(None):
            parts.append("null")
        elif (typing.get_origin(t) or t) is list:
            parts.append("a list of names" if typing.get_args(t) == (str,) else "a list")
        else:
            parts.append(words.get(t, getattr(t, "__name__", str(t))))
    return " or ".join(parts)


def coerce(name: str, value, hint):
    """YAML reads ``1e-6`` as a string and ``2`` as an int: convert to the field's type where that is lossless."""
    allowed = alternatives(hint)
    if float in allowed and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if list in [typing.get_origin(t) or t for t in allowed] and isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value

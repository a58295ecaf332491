"""Config values against their annotations: lossless coercion and wording for error messages."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union


def describe(tp: Any) -> str:
    """Human wording of an annotation, for error messages."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        parts = [describe(a) for a in typing.get_args(tp)]
        return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            dict: "a mapping", list: "a list", type(None): "null"}.get(tp, str(tp))


NO_MATCH = object()


def coerce(value: Any, tp: Any) -> Any:
    """`value` converted to `tp`, or NO_MATCH. Only lossless conversions (YAML reads 1e-4 as a string)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(tp):  # first exact match wins, then conversions
            if exact(value, arm):
                return value
        for arm in typing.get_args(tp):
            out = coerce(value, arm)
            if out is not NO_MATCH:
                return out
        return NO_MATCH
    if origin is Literal:
        if value is False and "no" in typing.get_args(tp):  # YAML 1.1 reads a bare `no` as false
            return "no"
        return value if value in typing.get_args(tp) and not isinstance(value, bool) else NO_MATCH
    if tp is type(None):
        return None if value is None else NO_MATCH
    if tp is bool:
        return value if isinstance(value, bool) else NO_MATCH
    if tp is int:
        if isinstance(value, float) and value.is_integer():  # `max_steps: 1e4` means 10000
            return int(value)
        return value if isinstance(value, int) and not isinstance(value, bool) else NO_MATCH
    if tp is float:
        if isinstance(value, bool):
            return NO_MATCH
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return NO_MATCH
        return NO_MATCH
    if tp is str:
        if isinstance(value, str):
            return value
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else NO_MATCH
    if tp is dict:
        return value if isinstance(value, dict) else NO_MATCH
    if tp is list:
        return value if isinstance(value, list) else NO_MATCH
    raise TypeError(f"unsupported annotation {tp}")  # a programming error, not user input


def exact(value: Any, tp: Any) -> bool:
    if typing.get_origin(tp) is Literal:
        return isinstance(value, str) and value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, float)
    return isinstance(tp, type) and isinstance(value, tp)


def literal_choices(tp: Any) -> list[str]:
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    return [c for arm in typing.get_args(tp) for c in literal_choices(arm)]

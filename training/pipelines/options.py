"""Typed per-family training options: each family declares a frozen dataclass, the spec carries JSON.

The run spec stays plain JSON (``RunSpec.family_options``); the family's ``options_type`` turns it into
a typed, validated object. The node layer and preflight call :func:`parse_family_options` to report
every problem before a run starts, and the training process calls it again to get the object the
adapter reads, so a hand-edited spec.json is checked the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a family that takes none."""

    def problems(self) -> list[str]:
        return []


def option_names(options_type: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(options_type))


def _type_problem(name: str, value: Any, default: Any) -> str | None:
    expected = type(default)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return None
    if isinstance(value, expected) and not (expected is not bool and isinstance(value, bool)):
        return None
    return f"family option {name!r} must be a {expected.__name__} (got {value!r})."


def parse_family_options(family: str, options_type: type, raw: Mapping[str, Any]) -> tuple[Any, list[str]]:
    """``(typed options, problems)``; with problems the options are the family's defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(options_type)}
    problems = []
    for name in raw:
        if name not in defaults:
            takes = ", ".join(defaults) or "none"
            problems.append(f"{family} models take no option {name!r} (their options: {takes}).")
    values = {}
    for name, value in raw.items():
        if name in defaults:
            problem = _type_problem(name, value, defaults[name])
            if problem:
                problems.append(f"{family}: {problem}")
            else:
                values[name] = float(value) if isinstance(defaults[name], float) else value
    if problems:
        return options_type(), problems
    options = options_type(**values)
    return options, [f"{family}: {p}" for p in options.problems()]


def options_from_inputs(options_type: type, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The family's options taken from node inputs of the same names (inputs it does not take are left out)."""
    return {name: inputs[name] for name in option_names(options_type) if inputs.get(name) is not None}

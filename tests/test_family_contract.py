"""Every registered family adapter implements the whole contract, with the contract's signatures.

``isinstance(adapter, FamilyAdapter)`` on a ``runtime_checkable`` Protocol only checks that names
exist, so it passes for any object with those attributes. This compares each method's parameters with
the Protocol's, so an adapter left behind by a contract change (a new argument, a renamed one, a
missing method) fails here instead of at the first training step of that family.
"""

from __future__ import annotations

import inspect

import pytest
from pipetrainer.training.pipelines.base import FamilyAdapter, adapter_for, known_families


def _contract() -> tuple[list[str], dict[str, inspect.Signature]]:
    attributes = [name for name in getattr(FamilyAdapter, "__annotations__", {}) if not name.startswith("_")]
    methods = {name: inspect.signature(value) for name, value in vars(FamilyAdapter).items()
               if inspect.isfunction(value) and not name.startswith("_")}
    return attributes, methods


def test_the_contract_is_read_from_the_protocol():
    attributes, methods = _contract()
    assert "name" in attributes and {"stage_layers", "lora_target_regex", "first_stage_inputs"} <= set(methods)


@pytest.mark.parametrize("family", known_families())
def test_the_adapter_implements_every_member_with_the_same_parameters(family):
    adapter = adapter_for(family)
    attributes, methods = _contract()
    missing = [name for name in [*attributes, *methods] if not hasattr(adapter, name)]
    assert not missing, f"{family} adapter lacks {missing}"
    assert adapter.name == family
    for name, expected in methods.items():
        got = inspect.signature(getattr(type(adapter), name))
        assert list(got.parameters) == list(expected.parameters), (
            f"{family}.{name}{got} does not take the contract's parameters {expected}")

"""The mutant list stays applicable: every mutant still finds its line and names tests that exist.

The mutation check itself (scripts/mutants.py, minutes) runs before resolving an issue that touches
training math, the LoRA format or the process tree (docs/mutation.md). This fast guard fails as soon
as an edit moves a mutant's line or renames a killer test, so the list cannot rot in between.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pipetrainer.devkit.mutation import load_mutants

PACK_DIR = Path(__file__).resolve().parent.parent
MUTANTS = load_mutants()


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
def test_the_mutant_applies_and_names_existing_tests(mutant):
    source = (PACK_DIR / mutant.file).read_text(encoding="utf-8")
    assert source.count(mutant.original) == 1, (
        f"{mutant.id}: {mutant.original!r} is in {mutant.file} {source.count(mutant.original)} times; "
        "update tests/mutants.toml to the new line")
    assert mutant.replacement != mutant.original
    for node_id in mutant.killers:
        file, _, name = node_id.partition("::")
        tree = ast.parse((PACK_DIR / file).read_text(encoding="utf-8"))
        tests = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not name or name.split("[")[0] in tests, f"{mutant.id}: no test {node_id}"


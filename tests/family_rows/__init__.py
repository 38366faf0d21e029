"""The rows of the family test table (tests/test_families.py), one module per family.

A family's module defines ``ROWS``: a list of :class:`Row`. This package collects every module's rows,
so adding a family to the table is adding one module here, and families never edit each other's rows.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

Loader = Callable[[Path, Any], Any]  # (comfy_root, fixture_paths) -> a fresh ComfyUI ModelPatcher


def _no_kwargs(cond: torch.Tensor, pooled: torch.Tensor | None, options: object,
               extras: Mapping[str, torch.Tensor]) -> dict:
    return {}


def _no_extras(model: Any, x0: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {}


@dataclasses.dataclass(frozen=True)
class Row:
    """One family (or one layout of a family) in the generic checks.

    ``load`` gives a fresh ModelPatcher each call (the LoRA checks change modules, so never shared);
    ``model_path`` the file ComfyUI detects for the process-tree checks (None: the model exists only
    in memory, e.g. built from ComfyUI's config class because detection pins full-size dims).
    ``extras`` makes the family's named extras (:class:`ExtraSpec`) of one batched example, seeded by
    ``g`` (``x0`` is the processed clean latent, ``[1, ...]``); ``comfy_kwargs`` the keyword arguments
    ComfyUI's ``BaseModel.apply_model`` takes for the same conditioning.
    """

    family: str
    tier: str
    load: Loader
    latent: tuple[int, ...]  # one example's raw latent shape
    tokens: int
    comfy_kwargs: Callable[[torch.Tensor, torch.Tensor | None, object, Mapping[str, torch.Tensor]], dict] = _no_kwargs
    model_path: Callable[[Path, Any], Path] | None = None
    extras: Callable[[Any, torch.Tensor, torch.Generator], dict[str, torch.Tensor]] = _no_extras
    id: str = ""  # test id when a family has several rows (defaults to the family)
    # How an in-memory row's 2-stage training compares with 1 stage (tests/test_stage_split.py): "bitwise";
    # "alike" (fp32 rounding after a step) for a row not yet shown bitwise: with the trainer's single backward per
    # stage (patches/deepspeed_pipe_backward.py) a cut does not change a gradient's summation order;
    # "as <row id>" where another row has the same stage layout (its split says it all).
    stage_split: str = "bitwise"

    @property
    def name(self) -> str:
        return self.id or self.family


def all_rows() -> list[Row]:
    """Every module's rows, in module-name order."""
    rows: list[Row] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        rows.extend(importlib.import_module(f"{__name__}.{info.name}").ROWS)
    names = [row.name for row in rows]
    bad_split = [row.name for row in rows if row.stage_split not in ("bitwise", "alike")
                 and row.stage_split.removeprefix("as ") not in names]
    if bad_split:
        raise ValueError(f"rows {bad_split}: stage_split is 'bitwise', 'alike' or 'as <another row id>'")
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"family rows share a name: {duplicated}; give them distinct ids")
    return rows

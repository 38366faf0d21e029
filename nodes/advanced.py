"""Inputs a first run does not need, folded away where the host's frontend can fold them.

ComfyUI 0.33 (its ``io.Input`` ``advanced`` flag) draws such inputs under the node's advanced section,
closed by default, so Train LoRA and Dataset open with what every run sets. Older hosts have no such flag:
there they stay ordinary widgets. Nothing else changes (names, order, defaults), so saved workflows load
with their values on every host.
"""

from __future__ import annotations

import inspect
from functools import cache

from comfy_api.latest import io


@cache
def _host_folds_inputs() -> bool:
    return "advanced" in inspect.signature(io.Input.__init__).parameters


def advanced() -> dict[str, bool]:
    """Keyword arguments for an input that belongs under the node's advanced section (empty on older hosts)."""
    return {"advanced": True} if _host_folds_inputs() else {}

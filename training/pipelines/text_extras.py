"""The text encoder's extra outputs the cache keeps, as the families declare them.

ComfyUI's text encoders hand some models more than the cond and the pooled vector: Anima's T5 token ids and
weights, the ByT5 glyph states of HunyuanImage 2.1 and HunyuanVideo 1.5, HiDream's stack of Llama layers. The
Cache node is model-agnostic (it sees only the CLIP), so it keeps every extra any registered family asks for.
A family declares them with a class attribute on its adapter, the name ComfyUI's encoder gives the output and
whether that tensor carries the batch axis (which the cache drops, as it drops the cond's)::

    text_extras = {"conditioning_llama3": True}

A new family with an extra of its own declares it there: no shared table to edit.
"""

from __future__ import annotations

from .base import adapter_for, known_families


def cached_text_extras() -> dict[str, bool]:
    """Every registered family's declared text-encoder extras: ``name -> batched``."""
    out: dict[str, bool] = {}
    for family in known_families():
        for name, batched in getattr(adapter_for(family), "text_extras", {}).items():
            if out.setdefault(name, batched) != batched:
                raise ValueError(f"Families declare the text extra {name!r} both with and without a batch axis.")
    return out

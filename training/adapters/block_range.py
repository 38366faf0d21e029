"""The LoRA Adapter's ``blocks`` text: which transformer blocks get adapters (pure Python, no torch).

A model's blocks are the entries of its block lists, the ``nn.ModuleList`` / ``nn.Sequential`` children
of the ComfyUI model that hold LoRA targets (training/pipelines/targets.py finds them), in the order the
model defines them, which is the order they run: Flux ``double_blocks`` then ``single_blocks``, SD3
``joint_blocks``, Wan ``blocks``, SDXL ``input_blocks``, ``middle_block``, ``output_blocks``.

Two ways to name blocks, mixable in one text, items separated by commas:

- ``0-9, 20``: one numbering over all block lists in that order (Flux.1 dev: double blocks 0-18,
  single blocks 19-56), the way the pipeline runs them;
- ``single_blocks:0-5`` (or an unambiguous start of the name, ``single:0-5``): that list's own index,
  the number in the LoRA file's keys (``diffusion_model.single_blocks.5....``).

An empty text selects every block. Targets outside every block list (none in the presets today) get
no adapter once a range is given. Syntax is checked without a model (:func:`parse_blocks`), the range
against the model's block counts by :func:`resolve_blocks`, whose errors name the counts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_ITEM = re.compile(r"^(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*:\s*)?(?P<start>\d+)(?:\s*-\s*(?P<end>\d+))?$")


@dataclass(frozen=True)
class BlockItem:
    """One comma-separated item: blocks ``start``..``end`` (inclusive) of the list ``name`` (None: the
    one numbering over every list)."""

    name: str | None
    start: int
    end: int

    def text(self) -> str:
        span = str(self.start) if self.start == self.end else f"{self.start}-{self.end}"
        return f"{self.name}:{span}" if self.name else span


class BlockRangeError(ValueError):
    """The ``blocks`` text is malformed or names blocks the model does not have."""


def parse_blocks(text: str) -> tuple[BlockItem, ...]:
    """The items of ``text`` (empty: all blocks). Raises :class:`BlockRangeError` naming the bad item."""
    items = []
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            if text.strip():
                raise BlockRangeError(f"blocks {text!r} has an empty item between commas: remove the extra comma.")
            continue
        match = _ITEM.match(part)
        if match is None:
            raise BlockRangeError(
                f"blocks item {part!r} is not a block number or range: write e.g. '0-9, 20' (one numbering over "
                "all blocks) or 'double_blocks:0-9, single_blocks:0-5' (each list's own numbers).")
        start = int(match["start"])
        end = int(match["end"]) if match["end"] is not None else start
        if end < start:
            raise BlockRangeError(f"blocks item {part!r} runs backwards: write {end}-{start}.")
        items.append(BlockItem(match["name"], start, end))
    return tuple(items)


def blocks_problems(text: str) -> list[str]:
    """The syntax problem of ``text``, if any (the spec's own check; the model's counts come later)."""
    try:
        parse_blocks(text)
    except BlockRangeError as exc:
        return [str(exc)]
    return []


def describe_lists(lists: Sequence[tuple[str, int]]) -> str:
    """``"57 blocks: double_blocks 0-18 (= 0-18), single_blocks 0-37 (= 19-56)"``."""
    parts, offset = [], 0
    for name, count in lists:
        parts.append(f"{name} 0-{count - 1} (= {offset}-{offset + count - 1})" if count else f"{name} (empty)")
        offset += count
    return f"{offset} blocks: " + ", ".join(parts)


def resolve_blocks(text: str, lists: Sequence[tuple[str, int]]) -> dict[str, frozenset[int]]:
    """``{list name: its chosen indices}`` for ``text`` on a model with block lists ``lists``
    (``(name, count)`` in run order). Empty text: every block. Raises :class:`BlockRangeError`
    naming the model's block counts when an item is past them or names no list."""
    items = parse_blocks(text)
    if not items:
        return {name: frozenset(range(count)) for name, count in lists}
    if not lists:
        raise BlockRangeError("This model has no block lists holding LoRA targets, so blocks cannot select any: "
                              "clear blocks.")
    chosen: dict[str, set[int]] = {name: set() for name, _ in lists}
    total = sum(count for _, count in lists)
    for item in items:
        if item.name is None:
            if item.end >= total:
                raise BlockRangeError(f"blocks item {item.text()!r} is past the model's {describe_lists(lists)}. "
                                      f"Use numbers 0-{total - 1}.")
            offset = 0
            for name, count in lists:
                chosen[name].update(i - offset for i in range(item.start, item.end + 1) if offset <= i < offset + count)
                offset += count
            continue
        name = _list_named(item.name, [n for n, _ in lists], lists)
        count = dict(lists)[name]
        if item.end >= count:
            raise BlockRangeError(f"blocks item {item.text()!r} is past {name}'s {count} blocks (0-{count - 1}); the "
                                  f"model has {describe_lists(lists)}.")
        chosen[name].update(range(item.start, item.end + 1))
    return {name: frozenset(indices) for name, indices in chosen.items()}


def _list_named(given: str, names: Sequence[str], lists: Sequence[tuple[str, int]]) -> str:
    if given in names:
        return given
    matches = [n for n in names if n.startswith(given)]
    if len(matches) == 1:
        return matches[0]
    kind = "matches several" if matches else "names none"
    raise BlockRangeError(f"blocks list name {given!r} {kind} of the model's block lists: "
                          f"{describe_lists(lists)}. Write one of {', '.join(names)}.")


def restrict_regex(target_regex: str, chosen: Mapping[str, frozenset[int]]) -> str:
    """``target_regex`` (full-matched against ComfyUI module paths) limited to paths under the chosen blocks."""
    alternatives = [rf"{re.escape(name)}\.({'|'.join(str(i) for i in sorted(indices))})"
                    for name, indices in chosen.items() if indices]
    if not alternatives:
        return r"(?!)"  # nothing: matches no path
    return rf"(?=(?:{'|'.join(alternatives)})\.)(?:{target_regex})"

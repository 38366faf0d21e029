"""Caption options: caption dropout and tag shuffle with the first N tags kept in place (pure Python).

Text embeddings are cached, so a tag shuffle cannot be drawn anew each step as trainers that encode
on the fly do: the cache encodes ``shuffle_variants`` shuffled versions of each caption (each its
own entry, keyed by its text) and training draws one of them per item and micro-batch. A variant
is a pure function of the caption, its number and the options, never of a run or a clock, so an
unchanged dataset yields the same texts, hence the same keys, on every cache run and nothing is
encoded twice.

Caption dropout trains an item on the empty caption's embedding instead, with probability
``dropout``: what ComfyUI's ``CLIPTextEncode`` gives for ``""`` with the same text encoder, i.e.
what the model is conditioned on when a prompt is left empty. The choice is made per item of each
micro-batch by the trainer (training/data/micro_batches.py), from a generator of its own.

A prompt prefix is what the sampling graph's text-encode node puts before every prompt (Lumina 2's
``CLIPTextEncodeLumina2``: its system prompt and ``" <Prompt Start> "``). It goes in front of every
cached text, the empty caption included (left empty, that node still encodes the prefix), and after
tag shuffling, so ``keep_tags`` counts the caption's own tags.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MAX_SHUFFLE_VARIANTS = 64  # each variant is one more cached embedding per caption


@dataclass(frozen=True)
class CaptionOptions:
    """``dropout``: share of items trained on the empty caption; ``shuffle_variants``: how many
    tag-shuffled versions of each caption are cached (0 = off, the caption as written);
    ``keep_tags``: how many leading tags stay in place; ``separator``: what separates tags;
    ``prefix``: text put before every cached text (the sampling text-encode node's template)."""

    dropout: float = 0.0
    shuffle_variants: int = 0
    keep_tags: int = 1
    separator: str = ","
    prefix: str = ""

    def problems(self) -> list[str]:
        out = []
        if not 0.0 <= self.dropout <= 1.0:
            out.append(f"caption_dropout is a probability in [0, 1] (got {self.dropout}).")
        if not 0 <= self.shuffle_variants <= MAX_SHUFFLE_VARIANTS:
            out.append(f"shuffle_tags must be between 0 (off) and {MAX_SHUFFLE_VARIANTS} cached variants "
                       f"(got {self.shuffle_variants}).")
        if self.keep_tags < 0:
            out.append(f"keep_tags must be >= 0 (0 shuffles every tag; got {self.keep_tags}).")
        if self.shuffle_variants and not self.separator.strip():
            out.append("tag_separator is empty: give the character between tags (usually ',').")
        return out

    def variants(self, caption: str) -> tuple[str, ...]:
        """The texts cached for ``caption``, distinct, in a fixed order, each behind the prefix: the
        caption itself when shuffling is off, else up to ``shuffle_variants`` shuffles (fewer when the
        tags allow fewer)."""
        if not self.shuffle_variants:
            return (self.prefix + caption,)
        return tuple(dict.fromkeys(self.prefix + shuffle_tags(caption, k, self.keep_tags, self.separator)
                                   for k in range(self.shuffle_variants)))

    def empty_text(self) -> str:
        """The text of the empty caption: what the sampling text-encode node encodes for an empty prompt."""
        return self.prefix

    def report(self) -> str:
        """One line for the Dataset node's report ("" when both options are off)."""
        parts = []
        if self.dropout > 0:
            parts.append(f"caption dropout {self.dropout:g} (empty caption's embedding)")
        if self.shuffle_variants:
            parts.append(f"{self.shuffle_variants} tag-shuffled variants per caption cached, first "
                         f"{self.keep_tags} tag(s) kept in place (separator {self.separator!r})")
        if self.prefix:
            parts.append(f"every caption encoded behind the prompt prefix {self.prefix!r}")
        return "; ".join(parts)


def split_tags(caption: str, separator: str = ",") -> list[str]:
    """The caption's tags, stripped, empty ones dropped."""
    return [t.strip() for t in caption.split(separator) if t.strip()]


def shuffle_tags(caption: str, variant: int, keep: int, separator: str = ",") -> str:
    """Variant ``variant`` of ``caption``: the first ``keep`` tags in place, the others shuffled by a
    generator seeded with the variant number, the options and the caption (the same text on every
    machine and run), joined by the separator and a space."""
    tags = split_tags(caption, separator)
    head, tail = tags[:keep], tags[keep:]
    random.Random(f"tags\x1f{variant}\x1f{keep}\x1f{separator}\x1f{caption}").shuffle(tail)
    joiner = separator if separator.isspace() else separator + " "
    return joiner.join(head + tail)

"""The start image in the prompt: captions encoded with the item's first frame, for text encoders that read it.

HunyuanVideo image-to-video (``model_base.HunyuanVideoI2V``) samples with a prompt encoded together with the
start image: ComfyUI's ``TextEncodeHunyuanVideo_ImageToVideo`` puts the llava CLIP-vision tokens of the image
(``CLIP Vision Encode`` of llava_llama3_vision, its ``mm_projected`` output) into the llava-llama3 prompt, and the
model reads them in front of the caption's tokens. A LoRA trained on captions encoded alone would learn under
other conditioning than it samples with. So with the Cache node's ``start_image = first_frame_alone``, a CLIP vision
model on its ``clip_vision`` input and a text encoder some family declares a *start-image prompt style* for
(``start_image_prompts`` on the adapter, e.g. training/pipelines/hunyuan_video_prompt.py), every caption of an item
is encoded with that item's start image (its first kept frame, at its bucket size: the frame its start-image
latent is made of) by the ComfyUI node the user samples with. The CLIP vision model then conditions the prompt,
so the latent entry gets no CLIP-vision features of its own (start_image.py).

Keys (keys.py): the style, its image interleave and crop, the CLIP vision model's identity, and the item's source
digest with its bucket's preprocessing (which fix the start image's pixels) join the text key of such a caption:
a changed first frame, bucket or CLIP vision model re-encodes the item's text. Each text entry also holds
``start_image_prompt`` (int64 ``[1]``: the image tokens in front of the caption), which the family requires, so a
cache made without the image in the prompt is refused before training instead of training silently on it.

MiniMax-H3's first/last-frame mode (``start_image = first_last_frames``) works the same way without a CLIP vision
model: ComfyUI's ``MiniMaxH3ImageToVideo`` hands the first and last frames to the Qwen3-VL text encoder itself
(``clip.tokenize(prompt, images=...)``), whose vision tokens then lead the caption's; a style says which images of
the item its node reads (``images``) and whether it needs a CLIP vision model (``clip_vision``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .keys import prep_signature, prompt_signature
from .media import load_image, load_video
from .plan import ItemPlan, KeyedTexts, keyed_texts
from .start_image import FIRST_FRAME_ALONE, StartImage, clip_vision_identity

START_IMAGE_PROMPT = "start_image_prompt"  # the text extra: how many image tokens lead the cond
IMAGE_TOKEN_TAGS = "minimax_token_tags"  # ComfyUI's MiniMax-H3 encoder output: 0 on an image's tokens, 1 on text


def first_frame(pixels: torch.Tensor) -> list[torch.Tensor]:
    """The item's first kept frame (``[1, H, W, 3]``), at its bucket: the start image of the I2V styles."""
    return [pixels[:1, ..., :3]]


@dataclass(frozen=True)
class StartImagePromptStyle:
    """How one ComfyUI node puts an item's start frame(s) into the prompt, for the Cache node's start_image ``mode``.

    ``conditioning(clip, caption, images, clip_vision_output, interleave)`` returns that node's CONDITIONING for the
    ``images`` the style takes of the item (``images(pixels)``: ``[1, H, W, 3]`` each, from the item's frames at its
    bucket) and, for a style with ``clip_vision``, the ``CLIP Vision Encode`` output of the first image (else None);
    ``takes(clip)`` says whether ``clip`` is the text encoder that reads it; ``crop`` is the ``CLIP Vision Encode``
    crop of the family's I2V workflow; ``version`` is part of the text key (bump it when ``conditioning`` or
    ``images`` changes). ``needs_encoder``, for a mode only this style gives its meaning (the frames enter no other
    prompt as the model samples): how to load the text encoder that ``takes`` it; the Cache refuses the mode with
    any other."""

    node: str
    version: int
    crop: str
    interleave: int
    takes: Callable[[object], bool]
    conditioning: Callable[[object, str, list, object, int], list]
    mode: str = FIRST_FRAME_ALONE
    images: Callable[[torch.Tensor], list[torch.Tensor]] = first_frame
    clip_vision: bool = True
    needs_encoder: str = ""


def _styles() -> list[StartImagePromptStyle]:
    from ..pipelines.base import adapter_for, known_families

    return [style for family in known_families() for style in getattr(adapter_for(family), "start_image_prompts", ())]


class StartImagePrompt:
    """One cache run's start-image prompt: the family's style and the Cache node's CLIP vision model."""

    def __init__(self, style: StartImagePromptStyle, clip_vision=None):
        self.style = style
        self.clip_vision = clip_vision
        self._identity: dict | None = None

    def problems(self) -> list[str]:
        """A CLIP vision model without the llava projector gives no tokens the prompt can take."""
        if not self.style.clip_vision:
            return []
        model = getattr(self.clip_vision, "model", None)
        if getattr(model, "multi_modal_projector", None) is None:
            return [f"The CLIP vision model connected to 'Cache Latents & Text' has no llava projector, so "
                    f"{self.style.node} cannot put the start image into the prompt: connect llava_llama3_vision "
                    "('Load CLIP Vision'), or disconnect clip_vision to encode captions alone (SkyReels I2V)."]
        return []

    def identity(self) -> dict:
        """What the text key records of the prompt (the item's image is keyed by its source and bucket)."""
        if self._identity is None:
            self._identity = {"start_image_prompt": self.style.node, "v": self.style.version}
            if self.style.clip_vision:
                self._identity.update(interleave=self.style.interleave, crop=self.style.crop,
                                      clip_vision=clip_vision_identity(self.clip_vision))
            else:
                self._identity["images"] = getattr(self.style.images, "__name__", "images")
        return self._identity

    @property
    def signature(self) -> str:
        return prompt_signature(self.identity())

    @staticmethod
    def image_of(p: ItemPlan) -> tuple[str, str]:
        """What fixes an item's start image at its bucket: the source's digest and the bucket's preprocessing."""
        return p.digest, prep_signature(p.prep)

    def keyed(self, texts: Iterable[str], text_sig: str, text_dtype: str, image: tuple[str, str]) -> KeyedTexts:
        """(key, text) of each text encoded with the start image ``image`` (:meth:`image_of`)."""
        return keyed_texts(texts, text_sig, text_dtype, self.signature, image)

    def empty_plans(self, planned: list[ItemPlan], plans: list[ItemPlan | None], text_sig: str,
                    text_dtype: str) -> list[ItemPlan | None]:
        """With caption dropout, each item's own empty-caption entry: the empty text with its start image, as the
        node encodes an empty prompt with the image (the model never samples without it)."""
        out: list[ItemPlan | None] = []
        for p, empty in zip(planned, plans, strict=True):
            own = None if empty is None else self.keyed((empty.text,), text_sig, text_dtype, self.image_of(p))
            out.append(None if own is None else dataclasses.replace(p, text_key=own[0][0], texts=own, variant=-1))
        return out

    def encode_item(self, clip, planned: ItemPlan, fps: float) -> dict[str, torch.Tensor]:
        """The plan's text with its item's frames at the plan's bucket (what the start latents are made of)."""
        path, bucket = planned.entry.path, planned.bucket
        pixels = load_video(path, bucket, fps) if planned.entry.is_video else load_image(path, bucket)
        return self.encode(clip, planned.text, pixels)

    def encode(self, clip, caption: str, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """``caption`` encoded with the style's images of ``pixels`` (``[F, H, W, C]``, the item at its bucket) as
        the style's node does. ``start_image_prompt`` holds the image tokens in front of the caption (with a CLIP
        vision model: its projected tokens kept by the interleave; without: the tokens the encoder tags as an
        image's, ``minimax_token_tags`` 0)."""
        from .encoders import _text_tensors

        images = self.style.images(pixels)
        output = None
        if self.style.clip_vision:
            output = self.clip_vision.encode_image(images[0], crop=self.style.crop == "center")
        ((cond, extras), *_) = self.style.conditioning(clip, caption, images, output, self.style.interleave)
        out = _text_tensors(cond, extras)
        if output is not None:
            tokens = -(-int(output["mm_projected"].shape[1]) // self.style.interleave)
        else:
            tags = extras.get(IMAGE_TOKEN_TAGS)
            tokens = int((tags == 0).sum()) if isinstance(tags, torch.Tensor) else 0
        out[START_IMAGE_PROMPT] = torch.tensor([tokens], dtype=torch.int64)
        return out


def start_image_prompt_for(start_image: StartImage, clip) -> tuple[StartImagePrompt | None, StartImage]:
    """``(prompt, latent start image)`` of a cache run: the style of the Cache's mode whose text encoder ``clip`` is
    (with a CLIP vision model where the style reads one, which then conditions the prompt, not the latent entry),
    or ``(None, start_image)``: captions encoded alone. A mode whose style ``needs_encoder`` is refused with another
    text encoder, and a CLIP vision model the style cannot use, with the fix."""
    styles = [s for s in _styles() if s.mode == start_image.mode]
    style = next((s for s in styles if clip is not None and s.takes(clip)
                  and (start_image.clip_vision is not None or not s.clip_vision)), None)
    if style is None:
        needed = [s for s in styles if s.needs_encoder]
        if needed:
            nodes = " or ".join(s.node for s in needed)
            hints = "; ".join(s.needs_encoder for s in needed)
            raise ValueError(f"start_image = {start_image.mode} puts each item's frames into its captions' prompt as "
                             f"{nodes} does, which needs that model's own text encoder on 'Cache Latents & Text' "
                             f"({hints}): connect it, or set start_image to none.")
        return None, start_image
    if not style.clip_vision:
        return StartImagePrompt(style), start_image
    prompt = StartImagePrompt(style, start_image.clip_vision)
    problems = prompt.problems()
    if problems:
        raise ValueError("\n".join(problems))
    return prompt, StartImage(start_image.mode)

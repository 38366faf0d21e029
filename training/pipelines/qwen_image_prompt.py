"""Qwen-Image-Edit's reference images in the text prompt: the two ComfyUI nodes that put them there.

ComfyUI has two text-encode nodes for the edit models, and they encode one image differently:

- ``TextEncodeQwenImageEditPlus`` (Qwen-Image-Edit 2509 and 2511; up to 3 images): an edit system
  prompt, ``Picture N: <|vision_start|><|image_pad|><|vision_end|>`` before the instruction for each
  image, every image scaled to about 384 x 384 pixels for the vision tower;
- ``TextEncodeQwenImageEdit`` (the first Qwen-Image-Edit; 1 image): the tokenizer's image template
  with no ``Picture 1:`` label, the image scaled to about 1024 x 1024 pixels.

So each is a style of its own (``edit_plus``, what ``auto`` picks, and ``edit``), and the cache encodes by
calling the node itself with ``vae=None`` (no reference latents: the cache encodes those), so a cached
embedding is the conditioning the user samples with, template and scaling included. The nodes are
read from ComfyUI when a caption is encoded (the Cache node runs inside ComfyUI); training processes
never call them. The text encoder that reads images is ComfyUI's Qwen-Image one (Qwen2.5-VL,
``comfy.text_encoders.qwen_image.QwenImageTEModel``, what ``CLIPLoader`` type ``qwen_image`` loads).
"""

from __future__ import annotations

import torch

from ..cache.reference_prompt import PromptStyle


def _output(result) -> list:
    """The CONDITIONING of a V3 node's ``NodeOutput`` (or a V1 tuple)."""
    return result.args[0] if hasattr(result, "args") else result[0]


def _edit_plus(clip, caption: str, images: list[torch.Tensor]) -> list:
    from comfy_extras.nodes_qwen import TextEncodeQwenImageEditPlus

    slots = {f"image{i + 1}": image for i, image in enumerate(images)}
    return _output(TextEncodeQwenImageEditPlus.execute(clip, caption, vae=None, **slots))


def _edit(clip, caption: str, images: list[torch.Tensor]) -> list:
    from comfy_extras.nodes_qwen import TextEncodeQwenImageEdit

    (image,) = images
    return _output(TextEncodeQwenImageEdit.execute(clip, caption, vae=None, image=image))


EDIT_PLUS = PromptStyle("edit_plus", "TextEncodeQwenImageEditPlus", max_images=3, version=1, conditioning=_edit_plus)
EDIT = PromptStyle("edit", "TextEncodeQwenImageEdit", max_images=1, version=1, conditioning=_edit)
STYLES = (EDIT_PLUS, EDIT)


def takes_reference_prompt(clip: object) -> bool:
    """Whether ``clip`` is ComfyUI's Qwen-Image text encoder (Qwen2.5-VL, which reads images)."""
    from comfy.text_encoders.qwen_image import QwenImageTEModel

    return isinstance(getattr(clip, "cond_stage_model", None), QwenImageTEModel)

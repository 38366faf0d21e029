"""HunyuanVideoI2V's prompt: ComfyUI's ``TextEncodeHunyuanVideo_ImageToVideo`` as the cache's start-image style.

The node tokenizes the caption into its image-to-video llava template with the start image's ``mm_projected``
tokens (llava_llama3_vision through ``CLIP Vision Encode``) at the template's ``<image>`` place, keeping every
``image_interleave``-th image token (its default, 2), and encodes it with HunyuanVideo's text encoder (ComfyUI's
``HunyuanVideoClipModel``: CLIP-L and llava-llama3, CLIP type ``hunyuan_video``). The cache calls the node itself
(it runs inside ComfyUI), so the template and the token handling stay ComfyUI's; training processes never call it.

``CLIP Vision Encode``'s crop is ``center``, the node's default (ComfyUI's documentation of the HunyuanVideo I2V
workflow names no other); a graph that samples with crop ``none`` conditions on a squashed image instead.
"""

from __future__ import annotations

from ..cache.start_image_prompt import StartImagePromptStyle

IMAGE_INTERLEAVE = 2  # TextEncodeHunyuanVideo_ImageToVideo's default
CLIP_CROP = "center"


def takes_start_image(clip: object) -> bool:
    """Whether ``clip`` is ComfyUI's HunyuanVideo text encoder (llava-llama3, which reads image tokens)."""
    from comfy.text_encoders.hunyuan_video import HunyuanVideoClipModel

    return isinstance(getattr(clip, "cond_stage_model", None), HunyuanVideoClipModel)


def _conditioning(clip, caption: str, images: list, clip_vision_output, interleave: int) -> list:
    from comfy_extras.nodes_hunyuan import TextEncodeHunyuanVideo_ImageToVideo

    result = TextEncodeHunyuanVideo_ImageToVideo.execute(clip, clip_vision_output, caption, interleave)
    return result.args[0] if hasattr(result, "args") else result[0]


HUNYUAN_VIDEO_I2V_PROMPT = StartImagePromptStyle(
    node="TextEncodeHunyuanVideo_ImageToVideo", version=1, crop=CLIP_CROP, interleave=IMAGE_INTERLEAVE,
    takes=takes_start_image, conditioning=_conditioning)

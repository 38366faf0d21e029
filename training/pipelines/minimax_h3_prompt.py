"""MiniMax-H3's first/last-frame prompt: ComfyUI's ``MiniMaxH3ImageToVideo`` as the cache's start-image style.

With ``first_frame`` and ``last_frame`` connected, the node tokenizes the prompt with both images
(``clip.tokenize(prompt, images=[first, last])``: MiniMax-H3's tokenizer writes ``<Picture 1>: `` and ``<Picture 2>:
`` each before the image's Qwen3-VL vision block, then the caption) and encodes it with the model's Qwen3-VL text
encoder (CLIP type ``minimax``), whose output also tags each token as text or image (``minimax_token_tags``, which the
model modulates as text or video). The cache makes the same two calls on the item's first and last kept frames at
its bucket (training/cache/start_image.py ``keyframe_images``); the node's third step, the frames' VAE latents, is the latent
entry's keyframes (training/cache/start_image.py ``first_last_frames``).
"""

from __future__ import annotations

from ..cache.start_image import FIRST_LAST_FRAMES, keyframe_images
from ..cache.start_image_prompt import StartImagePromptStyle


def takes_frames(clip: object) -> bool:
    """Whether ``clip`` is ComfyUI's MiniMax-H3 text encoder (Qwen3-VL, which reads the images of the prompt)."""
    try:
        from comfy.text_encoders.minimax import MiniMaxH3TEModel
    except ImportError:  # a ComfyUI without MiniMax-H3
        return False
    return isinstance(getattr(clip, "cond_stage_model", None), MiniMaxH3TEModel)


def _conditioning(clip, caption: str, images: list, clip_vision_output, interleave: int) -> list:
    """``MiniMaxH3ImageToVideo``'s conditioning before it adds the keyframe latents."""
    tokens = clip.tokenize(caption, images=images)
    return clip.encode_from_tokens_scheduled(tokens)


MINIMAX_H3_FRAMES_PROMPT = StartImagePromptStyle(
    node="MiniMaxH3ImageToVideo", version=1, crop="none", interleave=1, takes=takes_frames,
    conditioning=_conditioning, mode=FIRST_LAST_FRAMES, images=keyframe_images, clip_vision=False)

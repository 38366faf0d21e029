"""MiniMax-H3's prompts with pictures: ComfyUI's ``MiniMaxH3ImageToVideo`` as the cache's start-image style, and
``MiniMaxH3ReferenceToVideo`` with reference images as its reference-in-prompt style.

With ``first_frame`` and ``last_frame`` connected, the node tokenizes the prompt with both images
(``clip.tokenize(prompt, images=[first, last])``: MiniMax-H3's tokenizer writes ``<Picture 1>: `` and ``<Picture 2>:
`` each before the image's Qwen3-VL vision block, then the caption) and encodes it with the model's Qwen3-VL text
encoder (CLIP type ``minimax``), whose output also tags each token as text or image (``minimax_token_tags``, which the
model modulates as text or video). The cache makes the same two calls on the item's first and last kept frames at
its bucket (training/cache/start_image.py ``keyframe_images``); the node's third step, the frames' VAE latents, is the latent
entry's keyframes (training/cache/start_image.py ``first_last_frames``). With ``first_frame`` alone (image-to-video,
``start_image = first_keyframe``) the same happens with the first frame only, and with ``last_frame`` alone
(``last_keyframe``) with the last frame only.

With ``ref_images`` connected (``ref_image_size`` ``match``, its default), ``MiniMaxH3ReferenceToVideo`` scales each
reference, keeping its aspect, down to the pixel area of the video it generates (never up), rounds both sides to 32,
resizes it there (lanczos, no crop), and both tokenizes the prompt with the resized pictures
(``minimax_ref_items``: ``<Picture i>: `` and its vision block each, then the caption) and VAE-encodes them, each
alone, as the ``minimax_refs`` the model reads as condition rows. The cache does the same against the item's bucket
(training/cache/reference_prompt.py ``PromptStyle.size``). Its standalone reference audio (``ref_audios``, at most
three: the Dataset's audio files in the control folder) is a ``<Audio j>: `` label in the prompt, after the pictures
and videos, and the audio VAE's latent of the whole file. Its reference videos (``ref_videos``, at most three:
``name_video.mp4``... in the control folder) are sized and cut as the node does (:func:`size_video`), shown to
Qwen3-VL at 2 fps with their timestamps (each sound track's ``<Audio j>`` label first) and VAE-encoded whole.
"""

from __future__ import annotations

import math

import torch

from ..cache.reference_prompt import AudioInPrompt, PromptStyle, VideoInPrompt
from ..cache.start_image import FIRST_KEYFRAME, FIRST_LAST_FRAMES, LAST_KEYFRAME, keyframe_images
from ..cache.start_image_prompt import StartImagePromptStyle

REFERENCES_STYLE = "minimax_h3_references"
_CANVAS = 32  # the node's CANVAS_MULTIPLE


def reads_images(clip: object) -> bool:
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


def first_keyframe_image(pixels: torch.Tensor) -> list[torch.Tensor]:
    """``[first]``: the item's first kept frame, as ``MiniMaxH3ImageToVideo`` takes ``first_frame`` alone."""
    return keyframe_images(pixels)[:1]


def last_keyframe_image(pixels: torch.Tensor) -> list[torch.Tensor]:
    """``[last]``: the item's last kept frame, as ``MiniMaxH3ImageToVideo`` takes ``last_frame`` alone."""
    return keyframe_images(pixels)[1:]


def _keyframe_style(mode: str, images) -> StartImagePromptStyle:
    """``MiniMaxH3ImageToVideo`` with the frames ``images`` picks, for the Cache's start_image ``mode``."""
    return StartImagePromptStyle(node="MiniMaxH3ImageToVideo", version=1, crop="none", interleave=1,
                                 takes=reads_images, conditioning=_conditioning, mode=mode, images=images,
                                 clip_vision=False, needs_encoder="MiniMax-H3: 'Load CLIP' with type minimax")


MINIMAX_H3_FRAMES_PROMPT = _keyframe_style(FIRST_LAST_FRAMES, keyframe_images)
MINIMAX_H3_FIRST_FRAME_PROMPT = _keyframe_style(FIRST_KEYFRAME, first_keyframe_image)
MINIMAX_H3_LAST_FRAME_PROMPT = _keyframe_style(LAST_KEYFRAME, last_keyframe_image)


def match_size(image: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """A reference as ``MiniMaxH3ReferenceToVideo`` (``ref_image_size`` ``match``) sizes it for a ``width`` x
    ``height`` video: ``[1, th, tw, 3]``."""
    import comfy.utils

    h, w = image.shape[1], image.shape[2]
    scale = min(1.0, math.sqrt((width * height) / (w * h)))
    tw = max(_CANVAS, round(w * scale / _CANVAS) * _CANVAS)
    th = max(_CANVAS, round(h * scale / _CANVAS) * _CANVAS)
    pixels = image[:1, ..., :3].movedim(-1, 1)
    return comfy.utils.common_upscale(pixels, tw, th, "lanczos", "disabled").movedim(1, -1)


def size_video(frames: torch.Tensor, target_frames: int) -> torch.Tensor:
    """A reference video ``[F, H, W, 3]`` as ``MiniMaxH3ReferenceToVideo`` sizes and cuts it for a clip of
    ``target_frames`` frames: to the 768-short-edge canvas (``adapt_canvas``; a smaller video only rounded to 32),
    lanczos without a crop, then cut to the clip's aligned frame count and down to 17k + 5 frames."""
    import comfy.utils
    from comfy_extras.nodes_minimax_h3 import adapt_canvas, align_frame_count

    vh, vw = frames.shape[1], frames.shape[2]
    cw, ch = adapt_canvas(vw, vh)
    if vw * vh < cw * ch:
        cw, ch = (max(_CANVAS, round(s / _CANVAS) * _CANVAS) for s in (vw, vh))
    n = min(frames.shape[0], align_frame_count(max(5, target_frames)))
    if n < 5:
        raise ValueError(f"it has {frames.shape[0]} frames; MiniMax-H3 reference videos need at least 5 (~0.2 s at 24 "
                         "fps).")
    while n % 17 != 5:
        n -= 1
    pixels = frames[:n, ..., :3].movedim(-1, 1)
    return comfy.utils.common_upscale(pixels, cw, ch, "lanczos", "disabled").movedim(1, -1)


def _ref_items(item: torch.Tensor | VideoInPrompt | AudioInPrompt) -> list[dict]:
    """The node's ``minimax_ref_items`` of one reference: a picture; a video seen at 2 fps with its timestamps, its
    sound track's label first; an audio label."""
    if isinstance(item, AudioInPrompt):
        return [{"type": "audio"}]
    if not isinstance(item, VideoInPrompt):
        return [{"type": "image", "data": item}]
    from comfy_extras.nodes_minimax_h3 import FPS

    shown = list(range(0, item.frames.shape[0], FPS // 2))
    video = {"type": "video", "data": item.frames[shown], "timestamps": [i / 2.0 for i in range(len(shown))]}
    return [{"type": "audio"}, video] if item.with_sound else [video]


def _references(clip, caption: str, items: list[torch.Tensor | VideoInPrompt | AudioInPrompt]) -> list:
    """``MiniMaxH3ReferenceToVideo``'s conditioning before it adds the references' latents (``items``: the pictures
    sized, the videos sized and cut, the audio labels: the node's order)."""
    tokens = clip.tokenize(caption, minimax_ref_items=[entry for item in items for entry in _ref_items(item)])
    return clip.encode_from_tokens_scheduled(tokens)


MINIMAX_H3_REFERENCES = PromptStyle(REFERENCES_STYLE, "MiniMaxH3ReferenceToVideo", max_images=9, version=1,
                                    conditioning=_references, size=match_size, max_audio=3, max_videos=3,
                                    size_video=size_video)

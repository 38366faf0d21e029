"""MiniMax-H3: ComfyUI's own MiniMaxH3 config class at width 32 (the real model is 5376 wide, 33 B parameters), in
memory. The layout keeps H3's data flow: 2 single-stream DiT blocks over the packed ``[text | audio | video]``
sequence (a 2-stage split falls between them), a 1-block token refiner over the Qwen3-VL states, the video VAE's 24
latent channels and the audio VAE's stereo 32-channel latent. The example is what ComfyUI's sampler hands
``apply_model``: the video and the audio latent packed into one (``latent_shapes``), the audio carried at the model
sampling's ``audio_scale``."""

from __future__ import annotations

import torch

from . import Row
from .common import from_config, require_model_class

LATENT = (24, 2, 4, 6)  # the video latent [C, T, H, W]
AUDIO_FRAMES = 3  # audio latent frames: [32, 2, 3]
TEXT_DIM = 24  # the Qwen3-VL states' width (5120 in the real model)
UNET = {"image_model": "minimax_h3", "hidden_size": 32, "num_layers": 2, "token_refiner_num_layers": 1,
        "num_attention_heads": 2, "attention_head_dim": 16, "ffn_hidden_size": 32, "text_dim": TEXT_DIM,
        "timestep_input_dim": 16, "time_embed_hidden_size": 32, "time_embed_dim": 16, "rope_inv_freq_len": 2}


def h3_small(seed: int = 73):
    """30 k parameters, ComfyUI's MiniMaxH3Model; rotary frequencies as a trained model's (geometric)."""
    require_model_class("MiniMaxH3", "in ComfyUI v0.33")
    import comfy.supported_models

    patcher = from_config(comfy.supported_models.MiniMaxH3, UNET, seed=seed)
    inv = patcher.model.diffusion_model.rope.inv_freq
    inv.copy_(1.0 / 10000 ** (torch.arange(inv.shape[0], dtype=torch.float32) / inv.shape[0]))
    return patcher


def h3_kwargs(cond, pooled, options, extras):
    """What ``MiniMaxH3.extra_conds`` and the sampler hand the model: the Qwen3-VL states through the model's
    ``condition_proj`` and token refiner, the packed streams' shapes and the payload's ``audio_scale``."""
    model = h3_small().model
    shapes = [torch.Size((1, *LATENT)), torch.Size(extras["audio_latent"].shape)]
    with torch.no_grad():
        context = model.diffusion_model.preprocess_text_embeds(cond)
    model.latent_shapes = shapes
    return {"c_crossattn": context, "latent_shapes": shapes,
            "minimax_payload": {"audio_scale": model.model_sampling.audio_scale, "seed": 0}}


def _extras(model, x0, g):
    """The clip's stereo audio latent."""
    return {"audio_latent": torch.randn(1, 32, 2, AUDIO_FRAMES, generator=g)}


KEYFRAME = (24, 1, 4, 6)  # one image encoded alone: 1 latent frame at the clip's latent size
TAGS = (0, 0, 1, 0, 1)  # an image's vision tokens (0) in front of and inside the caption's (1)


def _keyframe_extras(model, x0, g):
    """First/last-frame mode (MiniMaxH3ImageToVideo with both frames): the keyframe latents and the prompt's token
    tags beside the audio latent."""
    return {**_extras(model, x0, g), "keyframe_first": torch.randn(1, *KEYFRAME, generator=g),
            "keyframe_last": torch.randn(1, *KEYFRAME, generator=g),
            "minimax_token_tags": torch.tensor([TAGS], dtype=torch.int64),
            "start_image_prompt": torch.tensor([[TAGS.count(0)]], dtype=torch.int64)}


def h3_keyframe_kwargs(cond, pooled, options, extras):
    """What ``MiniMaxH3.extra_conds`` hands the model for ``minimax_keyframes`` (first frame at pixel 0, last frame at
    the clip's last pixel frame: 2 latent frames are 1 + 4 pixel frames) and ``minimax_token_tags``."""
    kwargs = h3_kwargs(cond, pooled, options, extras)
    keyframes = [{"resolved_frame_index": 0, "latent": extras["keyframe_first"]},
                 {"resolved_frame_index": 4, "latent": extras["keyframe_last"]}]
    kwargs["minimax_payload"].update(keyframes=keyframes, cond_video_latents=[k["latent"] for k in keyframes],
                                     text_token_tags=extras["minimax_token_tags"][0])
    return kwargs


def _first_keyframe_extras(model, x0, g):
    """Image-to-video mode (MiniMaxH3ImageToVideo with first_frame only): the first frame's latent and the tags."""
    extras = _keyframe_extras(model, x0, g)
    del extras["keyframe_last"]
    return extras


def h3_first_keyframe_kwargs(cond, pooled, options, extras):
    """``minimax_keyframes`` with the first frame alone, at pixel frame 0."""
    kwargs = h3_kwargs(cond, pooled, options, extras)
    keyframes = [{"resolved_frame_index": 0, "latent": extras["keyframe_first"]}]
    kwargs["minimax_payload"].update(keyframes=keyframes, cond_video_latents=[keyframes[0]["latent"]],
                                     text_token_tags=extras["minimax_token_tags"][0])
    return kwargs


def _sound_guide_extras(model, x0, g):
    """Image-to-video with the clip's sound as an audio guide at frame 0 (MiniMaxH3ImageToVideo with first_frame,
    then MiniMaxH3AddGuide with audio): the first frame's latent, the guide's audio latent and the tags."""
    return {**_first_keyframe_extras(model, x0, g), "guide_audio": torch.randn(1, 32, 2, AUDIO_FRAMES, generator=g)}


def h3_sound_guide_kwargs(cond, pooled, options, extras):
    """``minimax_keyframes``: the first frame at pixel frame 0, then the guide's audio at frame 0."""
    kwargs = h3_first_keyframe_kwargs(cond, pooled, options, extras)
    guide = {"resolved_frame_index": 0, "audio_latent": extras["guide_audio"]}
    payload = kwargs["minimax_payload"]
    payload.update(keyframes=[*payload["keyframes"], guide], cond_audio_latents=[guide["audio_latent"]])
    return kwargs


REFERENCES = ((24, 4, 4), (24, 2, 6))  # two reference images, each at its own latent size [C, h, w]


def _reference_extras(model, x0, g):
    """Reference mode (MiniMaxH3ReferenceToVideo with two ref_images): each reference's latent at its own size and
    the prompt's token tags (the pictures' vision tokens) beside the audio latent."""
    refs = {f"reference_{i}": torch.randn(1, *shape, generator=g) for i, shape in enumerate(REFERENCES)}
    return {**_extras(model, x0, g), **refs, "minimax_token_tags": torch.tensor([TAGS], dtype=torch.int64)}


def h3_reference_kwargs(cond, pooled, options, extras):
    """What ``MiniMaxH3.extra_conds`` hands the model for ``minimax_refs`` of kind ``image`` (each one frame at its
    latent size, packed after the text and ahead of the targets' timeline) and ``minimax_token_tags``."""
    kwargs = h3_kwargs(cond, pooled, options, extras)
    refs = [{"kind": "image", "latent_h": shape[1], "latent_w": shape[2], "latent": extras[f"reference_{i}"][:, :, None]}
            for i, shape in enumerate(REFERENCES)]
    kwargs["minimax_payload"].update(refs=refs, cond_video_latents=[r["latent"] for r in refs],
                                     text_token_tags=extras["minimax_token_tags"][0])
    return kwargs


REFERENCE_AUDIO = (4, 2)  # two reference audio files' latent frames, [32, 2, Ta]


def _reference_audio_extras(model, x0, g):
    """Reference mode with sound (MiniMaxH3ReferenceToVideo with one ref_image and two ref_audios of their own
    lengths): the picture's latent, the audio latents and the prompt's token tags beside the clip's audio latent."""
    audio = {f"ref_audio_{i}": torch.randn(1, 32, 2, n, generator=g) for i, n in enumerate(REFERENCE_AUDIO)}
    return {**_extras(model, x0, g), "reference_0": torch.randn(1, *REFERENCES[1], generator=g), **audio,
            "minimax_token_tags": torch.tensor([TAGS], dtype=torch.int64)}


def h3_reference_audio_kwargs(cond, pooled, options, extras):
    """What ``MiniMaxH3.extra_conds`` hands the model for ``minimax_refs`` of kinds ``image`` then ``audio`` (the
    node's order): the picture's latent among ``cond_video_latents``, each audio's among ``cond_audio_latents``."""
    kwargs = h3_kwargs(cond, pooled, options, extras)
    shape = REFERENCES[1]
    refs = [{"kind": "image", "latent_h": shape[1], "latent_w": shape[2], "latent": extras["reference_0"][:, :, None]}]
    refs += [{"kind": "audio", "ref_audio_t": n, "audio_latent": extras[f"ref_audio_{i}"]}
             for i, n in enumerate(REFERENCE_AUDIO)]
    kwargs["minimax_payload"].update(refs=refs, cond_video_latents=[refs[0]["latent"]],
                                     cond_audio_latents=[r["audio_latent"] for r in refs[1:]],
                                     text_token_tags=extras["minimax_token_tags"][0])
    return kwargs


REFERENCE_VIDEOS = ((24, 2, 2, 4, 3), (24, 3, 4, 2, 0))  # [C, T, h, w] and the sound track's frames (0: none)


def _reference_video_extras(model, x0, g):
    """Reference mode with videos (MiniMaxH3ReferenceToVideo with two ref_videos, the first with its ref_video_audio,
    and one ref_audio): each video's latent at its own size and length, the sound latents and the token tags."""
    out = {**_extras(model, x0, g), "minimax_token_tags": torch.tensor([TAGS], dtype=torch.int64)}
    for k, (*shape, track) in enumerate(REFERENCE_VIDEOS):
        out[f"ref_video_{k}"] = torch.randn(1, *shape, generator=g)
        if track:
            out[f"ref_video_audio_{k}"] = torch.randn(1, 32, 2, track, generator=g)
    out["ref_audio_0"] = torch.randn(1, 32, 2, REFERENCE_AUDIO[0], generator=g)
    return out


def h3_reference_video_kwargs(cond, pooled, options, extras):
    """What ``MiniMaxH3.extra_conds`` hands the model for ``minimax_refs`` of kinds ``video_audio``, ``video`` and
    ``audio`` (the node's order): the videos' latents among ``cond_video_latents``, the first video's sound track and
    then the audio among ``cond_audio_latents``."""
    kwargs = h3_kwargs(cond, pooled, options, extras)
    refs = []
    for k, (_, t, h, w, track) in enumerate(REFERENCE_VIDEOS):
        refs.append({"kind": "video_audio" if track else "video", "latent_t": t, "latent_h": h, "latent_w": w,
                     "ref_audio_t": track, "latent": extras[f"ref_video_{k}"],
                     "audio_latent": extras.get(f"ref_video_audio_{k}")})
    refs.append({"kind": "audio", "ref_audio_t": REFERENCE_AUDIO[0], "audio_latent": extras["ref_audio_0"]})
    kwargs["minimax_payload"].update(refs=refs, cond_video_latents=[r["latent"] for r in refs if "latent" in r],
                                     cond_audio_latents=[r["audio_latent"] for r in refs
                                                         if r.get("audio_latent") is not None],
                                     text_token_tags=extras["minimax_token_tags"][0])
    return kwargs


ROWS = [
    Row("MiniMaxH3", "ComfyUI's MiniMaxH3 config class, 32 wide (the real model: 5376, 33 B), in memory",
        load=lambda comfy_root, fixture_paths: h3_small(), latent=LATENT, tokens=5, comfy_kwargs=h3_kwargs,
        extras=_extras),
    Row("MiniMaxH3", "the same model in first/last-frame mode: keyframe condition rows and an image's vision tokens in "
        "the prompt", load=lambda comfy_root, fixture_paths: h3_small(), latent=LATENT, tokens=len(TAGS),
        comfy_kwargs=h3_keyframe_kwargs, extras=_keyframe_extras, id="MiniMaxH3 keyframes"),
    Row("MiniMaxH3", "the same model in image-to-video mode: the first frame's keyframe condition rows alone",
        load=lambda comfy_root, fixture_paths: h3_small(), latent=LATENT, tokens=len(TAGS),
        comfy_kwargs=h3_first_keyframe_kwargs, extras=_first_keyframe_extras, id="MiniMaxH3 first keyframe"),
    Row("MiniMaxH3", "the same model in image-to-video mode with the clip's sound as an audio guide at frame 0",
        load=lambda comfy_root, fixture_paths: h3_small(), latent=LATENT, tokens=len(TAGS),
        comfy_kwargs=h3_sound_guide_kwargs, extras=_sound_guide_extras, id="MiniMaxH3 sound guide"),
    Row("MiniMaxH3", "the same model in reference mode: two reference images' condition rows, each at its own size, "
        "and their vision tokens in the prompt", load=lambda comfy_root, fixture_paths: h3_small(), latent=LATENT,
        tokens=len(TAGS), comfy_kwargs=h3_reference_kwargs, extras=_reference_extras, id="MiniMaxH3 references"),
    Row("MiniMaxH3", "the same model in reference mode with sound: a reference image's and two reference audio files' "
        "condition rows", load=lambda comfy_root, fixture_paths: h3_small(), latent=LATENT, tokens=len(TAGS),
        comfy_kwargs=h3_reference_audio_kwargs, extras=_reference_audio_extras, id="MiniMaxH3 reference audio"),
    Row("MiniMaxH3", "the same model in reference mode with videos: two reference videos' condition rows (one with its "
        "sound track's) and a reference audio's", load=lambda comfy_root, fixture_paths: h3_small(), latent=LATENT,
        tokens=len(TAGS), comfy_kwargs=h3_reference_video_kwargs, extras=_reference_video_extras,
        id="MiniMaxH3 reference video"),
]

"""``Cache Latents & Text``: encode the dataset once with the graph's VAE and text encoder."""

from __future__ import annotations

import os

import comfy.utils
import folder_paths
from comfy_api.latest import io, ui

from ..training.cache import reference_prompt
from ..training.cache.clip_sound import AUDIO_GUIDES, NO_GUIDE, ClipSound
from ..training.cache.encoders import text_encoder_problems
from ..training.cache.keys import TEXT_STORE_DTYPES
from ..training.cache.s2v_sound import S2VSound
from ..training.cache.start_image import NO_START_IMAGE, START_IMAGE_MODES, StartImage
from ..training.cache.store import build_cache
from ..training.cache.vace_control import VACE_CONTROL_MODES, VaceControl
from ..training.data.dataset import is_audio, is_picture, is_video
from .advanced import advanced
from .checks import preflight
from .load_video import LoadVideoReader
from .run.progress_text import show_text
from .types import CATEGORY, Cache, Dataset


def cache_root() -> str:
    return os.path.join(folder_paths.get_output_directory(), "pipetrainer", "cache")


class PipeTrainerCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerCache",
            display_name="Cache Latents & Text (PipeTrainer)",
            category=CATEGORY,
            # Not an output node: if Train LoRA fails validation, ComfyUI must refuse the whole queue (an
            # output node here would still run and the job would show as a success). To cache without
            # training, wire the report to the stock 'Preview Any' node.
            description="Encodes images/videos to latents and captions to text embeddings, keyed by content, "
                        "preprocessing and encoder identity (weights, dtype, clip skip, tokenizer options, "
                        "text-encoder LoRAs), so a changed file, caption, bucket or encoder can never reuse "
                        "stale data. Reference images of an edit dataset (the Dataset node's control folder) are "
                        "encoded with the same VAE at their target's bucket size into the target's entry; a changed "
                        "reference re-encodes its item only. For image-to-video models (Wan I2V), start_image first_frame "
                        "also caches each item's start-image conditioning as WanImageToVideo (and, with a CLIP "
                        "vision model, CLIP Vision Encode) builds it; for HunyuanVideo 1.5 I2V, first_frame_alone as "
                        "HunyuanVideo15ImageToVideo does; for MiniMax-H3, first_last_frames as MiniMaxH3ImageToVideo "
                        "with both frames (first_keyframe, last_keyframe: one of them). Reports cached / reused / "
                        "re-encoded (why) / skipped (why).",
            inputs=[
                Dataset.Input("dataset", tooltip="From the Dataset node."),
                io.Vae.Input("vae", tooltip="The VAE of the model family you train; it also encodes the "
                             "dataset's reference images, if any."),
                io.Clip.Input("clip", tooltip="The text encoder(s) of the model family you train. Clip skip "
                              "(CLIP Set Last Layer), tokenizer options and LoRAs loaded onto it are part of "
                              "the cache key: change one and the captions are encoded again."),
                io.Combo.Input("text_dtype", options=list(TEXT_STORE_DTYPES), default="bf16", optional=True,
                               tooltip="Dtype the text embeddings are stored in: set it to the Train node's "
                                       "training_dtype. bf16 halves the cache and what each training rank reads; "
                                       "caches written in fp32 before still load."),
                io.Combo.Input("start_image", options=list(START_IMAGE_MODES), default=NO_START_IMAGE, optional=True,
                               tooltip="first_frame: WanImageToVideo (Wan I2V); first_frame_alone: "
                                       "HunyuanVideo15ImageToVideo / HunyuanImageToVideo; first_last_frames, "
                                       "first_keyframe, last_keyframe: MiniMaxH3ImageToVideo; none: text only."),
                io.ClipVision.Input("clip_vision", optional=True,
                                    tooltip="The I2V workflow's CLIP vision model: clip_vision_h (Wan 2.1 I2V), "
                                            "sigclip_vision_patch14_384 (HunyuanVideo 1.5), llava_llama3_vision "
                                            "(HunyuanVideo I2V: into the prompt). Wan 2.2 / SkyReels: none."),
                io.Combo.Input("reference_in_prompt", options=reference_prompt.modes(), default=reference_prompt.AUTO,
                               optional=True,
                               tooltip="References with an image-reading text encoder (Qwen-Image-Edit, "
                                       "MiniMax-H3, its audio too): each caption encoded with them as your node "
                                       "does (edit_plus, edit, minimax_h3_references); auto picks."),
                io.Combo.Input("vace_control", options=list(VACE_CONTROL_MODES), default="off", optional=True,
                               tooltip="Wan 2.1 VACE: on caches each clip's controls (name.mp4, name.2.mp4..., "
                                       "masks, name_ref.png) as WanVaceToVideo builds them; images train as "
                                       "1-frame clips. off: other models."),
                io.Vae.Input("audio_vae", optional=True,
                             tooltip="LTX-2 ('LTXV Audio VAE Loader') or MiniMax-H3 ('Load VAE'): each clip's "
                                     "sound, cut to the kept frames, is cached with it (silence for clips without "
                                     "sound). Needs no torchaudio."),
                io.AudioEncoder.Input("audio_encoder", optional=True,
                                      tooltip="Wan 2.2 S2V only: wav2vec2 from 'Load Audio Encoder'. Caches each "
                                              "clip's sound (16 fps) as WanSoundImageToVideo gets it, and its first "
                                              "frame as the reference image. README: Cache."),
                io.Combo.Input("audio_guide", options=list(AUDIO_GUIDES), default=NO_GUIDE, optional=True,
                               tooltip="MiniMax-H3: clip_sound caches each clip's sound as MiniMaxH3AddGuide's "
                                       "audio guide at frame 0 (sound-driven video); needs audio_vae. none: other "
                                       "models.", **advanced()),
            ],
            outputs=[Cache.Output(display_name="cache", tooltip="Cached training examples for Train LoRA."),
                     io.String.Output(display_name="report", tooltip="Encoded / reused / skipped, file by file.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, dataset, vae, clip, text_dtype: str = "bf16", start_image: str = NO_START_IMAGE,
                clip_vision=None, reference_in_prompt: str = reference_prompt.AUTO,
                vace_control: str = "off", audio_vae=None, audio_encoder=None,
                audio_guide: str = NO_GUIDE) -> io.NodeOutput:
        bar = comfy.utils.ProgressBar(1)

        def progress(done: int, total: int) -> None:
            bar.update_absolute(done, total)

        # Refuse a text encoder the cache key cannot describe before preflight encodes with it.
        start = StartImage(start_image, clip_vision)
        vace = VaceControl(vace_control, vae)
        dataset = vace.dataset(dataset)  # on: an image-only control folder's plain names are VACE control images
        names = [os.path.basename(e.path) for e in dataset.entries]
        counts = {kind: [(n, sum(map(of, e.references))) for n, e in zip(names, dataset.entries, strict=True)]
                  for kind, of in (("pictures", is_picture), ("audio", is_audio), ("videos", is_video))}
        style, prompt_problems = reference_prompt.choose(reference_in_prompt, clip, counts["pictures"],
                                                         counts["audio"], counts["videos"])
        s2v = S2VSound(audio_encoder)  # refuses an encoder that is not wav2vec2, naming the loader
        sound = ClipSound(audio_vae, audio_guide)  # refuses a VAE that is no audio VAE it knows (LTX-2, MiniMax-H3), naming the loaders
        flip = getattr(dataset, "flip", "none")
        problems = (start.problems() or vace.problems(dataset.entries, flip)
                    or s2v.problems(dataset.bucket_settings.fps, flip)
                    or sound.problems(dataset.bucket_settings.fps) or prompt_problems or text_encoder_problems(clip)
                    or preflight.cache_problems(dataset, vae, clip, cache_root()))
        if problems:
            raise ValueError("\n".join(problems))
        result = build_cache(dataset, vae, clip, cache_root(), progress, text_dtype, start, style, vace, sound, s2v,
                             LoadVideoReader())
        report = result.report.text()
        if not result.items:
            raise ValueError(f"No item could be cached from {dataset.folder}:\n{report}")
        shown = result.report.summary()  # the node keeps a few files of each kind; the output lists them all
        show_text(shown, cls.hidden.unique_id if cls.hidden is not None else None)  # drawn on the node
        return io.NodeOutput(result, report, ui=ui.PreviewText(shown))

"""``Dataset``: a folder of images and videos with same-name .txt captions, plus bucket settings, an
optional control folder of reference images (edit models: the training image is the target), and the
cached flip and loss-mask variants (training/cache/masks.py)."""

from __future__ import annotations

import os

import folder_paths
from comfy_api.latest import io, ui

from ..training.data.captions import MAX_SHUFFLE_VARIANTS, CaptionOptions
from ..training.data.dataset import CAPTION_POLICIES, BucketSettings, DatasetError, folder_fingerprint, scan_dataset
from ..training.data.dataset_masks import FLIP_MODES, MASK_MODES
from .advanced import advanced
from .node_problems import refuse_once
from .types import CATEGORY, Dataset


def resolve_folder(folder: str) -> str:
    """Absolute paths as given; relative ones inside ComfyUI's input folder."""
    folder = folder.strip()
    return folder if os.path.isabs(folder) else os.path.join(folder_paths.get_input_directory(), folder)


def parse_resolutions(resolution: int, extra: str) -> tuple[int, ...]:
    """``resolution`` first, then the comma-separated extra ones (duplicates dropped)."""
    values = [resolution]
    for part in extra.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise DatasetError(f"extra_resolutions must be whole numbers separated by commas (got {part!r}).")
        values.append(int(part))
    return tuple(dict.fromkeys(values))


class PipeTrainerDataset(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerDataset",
            display_name="Dataset (PipeTrainer)",
            category=CATEGORY,
            inputs=[
                io.String.Input("folder", default="pipetrainer_demo",
                                tooltip="Folder of images/videos with same-name .txt captions; relative paths are "
                                        "inside ComfyUI's input folder."),
                io.Int.Input("resolution", default=512, min=64, max=4096, step=16,
                             tooltip="Training resolution: each item is resized to cover its bucket (about "
                                     "resolution x resolution pixels) and center-cropped."),
                io.Int.Input("repeats", default=1, min=1, max=1000,
                             tooltip="How many times each item appears per epoch."),
                io.Combo.Input("missing_caption", options=list(CAPTION_POLICIES), default="error",
                               tooltip="Files without a caption: 'error' names them and stops, 'skip' drops "
                                       "them, 'empty' trains them with an empty caption (both reported)."),
                io.Int.Input("aspect_buckets", default=1, min=1, max=64, optional=True,
                             tooltip="Number of aspect-ratio buckets, log-spaced between min and max ratio; "
                                     "1 = square only. Each item goes to the bucket closest to its shape.", **advanced()),
                io.Float.Input("min_ratio", default=0.5, min=0.1, max=1.0, step=0.05, optional=True,
                               tooltip="Narrowest bucket (width / height), e.g. 0.5 for 1:2 portraits.", **advanced()),
                io.Float.Input("max_ratio", default=2.0, min=1.0, max=10.0, step=0.05, optional=True,
                               tooltip="Widest bucket (width / height), e.g. 2.0 for 2:1 landscapes.", **advanced()),
                io.String.Input("extra_resolutions", default="", optional=True,
                                tooltip="More training resolutions, comma-separated (e.g. '256, 768'): every item "
                                        "is cached once per resolution (multi-resolution training).", **advanced()),
                io.Float.Input("video_fps", default=16.0, min=1.0, max=120.0, step=1.0, optional=True,
                               tooltip="Videos are resampled to this frame rate before cutting frame buckets.", **advanced()),
                io.Int.Input("max_frames", default=33, min=1, max=1024, optional=True,
                             tooltip="Longest video clip in frames; clips use 1 or 4k+1 frames.", **advanced()),
                io.String.Input("control_folder", default="", optional=True,
                                tooltip="Edit models: references named like the training files (name.png, "
                                        "name_1.png; H3: name.wav, name_video.mp4). Wan VACE: name.mp4 "
                                        "(name.2.mp4...), name_mask, name_ref.png. In ComfyUI's input folder.",
                                **advanced()),
                io.Float.Input("caption_dropout", default=0.0, min=0.0, max=1.0, step=0.01, optional=True,
                               tooltip="Share of items trained on the empty caption, drawn per item and step "
                                       "(0.05-0.1 is usual; helps prompt-less use and CFG). 0 = off.", **advanced()),
                io.Int.Input("shuffle_tags", default=0, min=0, max=MAX_SHUFFLE_VARIANTS, optional=True,
                             tooltip="For tag-list captions: how many shuffled versions of each caption are "
                                     "cached; training draws one per item and step. 0 = off (the caption as "
                                     "written).", **advanced()),
                io.Int.Input("keep_tags", default=1, min=0, max=64, optional=True,
                             tooltip="With shuffle_tags: the first N tags stay in place (e.g. the trigger word); "
                                     "0 shuffles every tag.", **advanced()),
                io.String.Input("tag_separator", default=",", optional=True,
                                tooltip="With shuffle_tags: what separates the tags of a caption (usually ',').", **advanced()),
                io.String.Input("prompt_prefix", default="", optional=True,
                                tooltip="Text your sampling graph's text-encode node puts before every prompt "
                                        "(Lumina 2's system prompt); put before every caption. Empty for most "
                                        "models; trigger words go in the captions.", **advanced()),
                io.Combo.Input("flip", options=list(FLIP_MODES), default="none", optional=True,
                               tooltip="random: each item also trains mirrored left-right, half the time (a "
                                       "second cached latent). Not for edit datasets nor for subjects whose sides"
                                       " matter (text, logos).", **advanced()),
                io.Combo.Input("mask", options=list(MASK_MODES), default="none", optional=True,
                               tooltip="Masked loss: white trains, black is ignored, grey weighs between. alpha: "
                                       "each image's transparency; folder: mask images from mask_folder.", **advanced()),
                io.String.Input("mask_folder", default="", optional=True,
                                tooltip="With mask 'folder': one mask per training file, named like it (name.png "
                                        "for name.jpg). Inside ComfyUI's input folder.", **advanced()),
            ],
            outputs=[Dataset.Output(display_name="dataset", tooltip="The images, videos and captions to cache."),
                     io.String.Output(display_name="report", tooltip="What was found, skipped or left empty.")],
        )

    @classmethod
    def fingerprint_inputs(cls, folder: str, control_folder: str = "", mask_folder: str = "", **_settings) -> str:
        """Re-run when a file in the folder, the control folder or the mask folder changes, not only when
        an input does."""
        if not folder.strip():  # execute refuses it; do not fingerprint the whole input folder first
            return ""
        control = folder_fingerprint(resolve_folder(control_folder)) if control_folder.strip() else ""
        masks = folder_fingerprint(resolve_folder(mask_folder)) if mask_folder.strip() else ""
        return folder_fingerprint(resolve_folder(folder)) + control + masks

    @classmethod
    def validate_inputs(cls, folder: str | None = None, missing_caption: str | None = None,
                        control_folder: str | None = "", mask: str | None = "none", mask_folder: str | None = "",
                        extra_resolutions: str | None = "") -> bool:
        """The folder's one-pass check at queue time, so its problems (a missing folder, missing captions, files
        that cannot be read, unpaired references and masks) come in the same answer as every other node's, once
        on this node (nodes/node_problems.py). A linked input has no value yet: then :meth:`execute` checks.
        Buckets, resolution and caption options are checked by :meth:`execute` (ComfyUI range-checks the
        numbers it is not given here)."""
        values = (folder, missing_caption, control_folder, mask, mask_folder, extra_resolutions)
        if any(v is None for v in values):
            return True
        problems = []
        try:
            parse_resolutions(64, extra_resolutions)
        except DatasetError as exc:
            problems.append(str(exc))
        if not folder.strip():
            problems.append("folder is empty: give a folder of captioned images.")
        else:
            try:
                scan_dataset(resolve_folder(folder), 512, missing_caption=missing_caption,
                             control_folder=resolve_folder(control_folder) if control_folder.strip() else None,
                             mask=mask, mask_folder=resolve_folder(mask_folder) if mask_folder.strip() else None)
            except DatasetError as exc:
                problems.append(str(exc))
        return refuse_once(problems)

    @classmethod
    def bucket_settings(cls, resolution: int, aspect_buckets: int = 1, min_ratio: float = 0.5,
                        max_ratio: float = 2.0, extra_resolutions: str = "", video_fps: float = 16.0,
                        max_frames: int = 33) -> BucketSettings:
        square = aspect_buckets == 1
        return BucketSettings(resolutions=parse_resolutions(resolution, extra_resolutions),
                              min_ratio=1.0 if square else min_ratio, max_ratio=1.0 if square else max_ratio,
                              count=aspect_buckets, max_frames=max_frames, fps=video_fps)

    @classmethod
    def execute(cls, folder: str, resolution: int, repeats: int, missing_caption: str, aspect_buckets: int = 1,
                min_ratio: float = 0.5, max_ratio: float = 2.0, extra_resolutions: str = "",
                video_fps: float = 16.0, max_frames: int = 33, control_folder: str = "", caption_dropout: float = 0.0,
                shuffle_tags: int = 0, keep_tags: int = 1, tag_separator: str = ",", prompt_prefix: str = "",
                flip: str = "none", mask: str = "none", mask_folder: str = "") -> io.NodeOutput:
        if not folder.strip():
            raise ValueError("folder is empty: give a folder of captioned images.")
        try:
            settings = cls.bucket_settings(resolution, aspect_buckets, min_ratio, max_ratio, extra_resolutions,
                                           video_fps, max_frames)
            control = resolve_folder(control_folder) if control_folder.strip() else None
            captions = CaptionOptions(caption_dropout, shuffle_tags, keep_tags, tag_separator, prompt_prefix)
            masks = resolve_folder(mask_folder) if mask_folder.strip() else None
            dataset = scan_dataset(resolve_folder(folder), resolution, repeats, missing_caption, settings, control,
                                   captions, flip=flip, mask=mask, mask_folder=masks)
        except DatasetError as exc:
            raise ValueError(str(exc)) from None
        report = dataset.report()  # on the node too: what was found, and every file skipped and why
        return io.NodeOutput(dataset, report, ui=ui.PreviewText(report))

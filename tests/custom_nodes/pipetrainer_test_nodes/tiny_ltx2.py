"""Test node: LTX-2's text encoder as ``LTXAVTextEncoderLoader`` loads it, with the tiny Gemma 3 (current ComfyUI only).

The stock node builds Gemma 3 at its pinned 12 B size whatever the file holds; this one runs the same steps on the
same two files (the Gemma file from ``models/text_encoders``, the LTX-2 checkpoint with its text projection from
``models/checkpoints``) with the tiny Gemma model class: :func:`.tiny_gemma3.load_ltxav_text_encoder`.
"""

from __future__ import annotations


class TinyLTXAVTextEncoderLoader:
    """Test node: the tiny-Gemma LTX-2 text encoder as a CLIP, in place of LTXAVTextEncoderLoader."""

    @classmethod
    def INPUT_TYPES(cls):
        import folder_paths

        return {"required": {"text_encoder": (folder_paths.get_filename_list("text_encoders"),),
                             "ckpt_name": (folder_paths.get_filename_list("checkpoints"),)}}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "PipeTrainer/tests"
    DESCRIPTION = "Test only: LTXAVTextEncoderLoader's steps with a tiny Gemma 3 in place of the pinned 12 B one."

    def load(self, text_encoder: str, ckpt_name: str):
        import folder_paths

        from .tiny_gemma3 import load_ltxav_text_encoder

        return (load_ltxav_text_encoder(folder_paths.get_full_path_or_raise("text_encoders", text_encoder),
                                        folder_paths.get_full_path_or_raise("checkpoints", ckpt_name),
                                        folder_paths.get_folder_paths("embeddings")),)


NODE_CLASS_MAPPINGS = {"PipeTrainerTestTinyLTXAVTextEncoderLoader": TinyLTXAVTextEncoderLoader}
NODE_DISPLAY_NAME_MAPPINGS = {"PipeTrainerTestTinyLTXAVTextEncoderLoader": "Tiny LTX-2 Text Encoder Loader (test)"}

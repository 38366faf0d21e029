"""Tiny Qwen3 text encoders from ComfyUI's own classes: Z-Image's, and FLUX.2 Klein's where the host has it.

- Z-Image (``CLIPLoader`` type ``lumina2`` detects a Qwen3-4B file as Z-Image's): ComfyUI's
  ``comfy.text_encoders.z_image``: ``ZImageTokenizer`` (the chat template around the caption, Qwen's
  tokenizer shipped with ComfyUI) and ``ZImageTEModel`` with its ``Qwen3_4BModel`` (second-to-last
  hidden state, attention masks), at hidden 40 (the Z-Image fixture's width in tests/family_rows/lumina2.py;
  the real model's is 2560), 3 layers.
- FLUX.2 Klein (current ComfyUI only; ``CLIPLoader`` type ``flux2``): ``comfy.text_encoders.flux``'s
  ``KleinTokenizer`` (its thinking-template, padding to 512 tokens) and ``klein_te`` (hidden states 9,
  18 and 27, i.e. the inputs of those layers, stacked into one ``3 x hidden`` wide cond by
  ``Flux2TEModel``), at hidden 8 and the 28 layers those indices need.

Only the transformer's size is changed (:mod:`.tiny_llm`); one attention head of Qwen3's real head
width 128. The vocabulary stays the tokenizer's (151936 ids: the template's special tokens are above
151643), so the token embedding is most of the parameters.
"""

from __future__ import annotations

from .tiny_llm import build_clip, seed_input, with_clip_model, with_config

ZIMAGE_HIDDEN = 40
KLEIN_HIDDEN = 8
QWEN3_VOCAB = 151936
TINY_ZIMAGE_QWEN3_CONFIG = {"vocab_size": QWEN3_VOCAB, "hidden_size": ZIMAGE_HIDDEN, "intermediate_size": 2 * ZIMAGE_HIDDEN,
                            "num_hidden_layers": 3, "num_attention_heads": 1, "num_key_value_heads": 1}
TINY_KLEIN_QWEN3_CONFIG = {"vocab_size": QWEN3_VOCAB, "hidden_size": KLEIN_HIDDEN, "intermediate_size": 2 * KLEIN_HIDDEN,
                           "num_hidden_layers": 28, "num_attention_heads": 1, "num_key_value_heads": 1}


def tiny_zimage_qwen3_clip(seed: int = 2560, embedding_directory=None):
    """A ``comfy.sd.CLIP`` as ComfyUI builds Z-Image's Qwen3-4B text encoder, at hidden 40."""
    import comfy.text_encoders.z_image as z_image

    model = with_config(z_image.Qwen3_4BModel, TINY_ZIMAGE_QWEN3_CONFIG)
    te = with_clip_model(z_image.te(), model)
    return build_clip(te, z_image.ZImageTokenizer, seed, norm_center=1.0, embedding_directory=embedding_directory)


def has_klein() -> bool:
    """Whether this ComfyUI has FLUX.2 Klein's Qwen3 text encoder (current ComfyUI; 0.3.75 has not)."""
    import comfy.text_encoders.flux as flux

    return hasattr(flux, "klein_te") and hasattr(flux, "KleinTokenizer")


def tiny_klein_qwen3_clip(seed: int = 7680, embedding_directory=None):
    """A ``comfy.sd.CLIP`` as ComfyUI builds FLUX.2 Klein's Qwen3-4B text encoder, at hidden 8 (cond width 24)."""
    import comfy.text_encoders.flux as flux

    if not has_klein():
        raise RuntimeError("This ComfyUI has no FLUX.2 Klein text encoder (comfy.text_encoders.flux.klein_te); "
                           "update ComfyUI.")
    model = with_config(flux.Qwen3_4BModel, TINY_KLEIN_QWEN3_CONFIG)
    te = with_clip_model(flux.klein_te(model_type="qwen3_4b"), model)
    return build_clip(te, flux.KleinTokenizer, seed, norm_center=1.0, embedding_directory=embedding_directory)


# Kept for the brief's name: the Qwen3 encoder of the family the issue names first (Z-Image).
tiny_qwen3_clip = tiny_zimage_qwen3_clip


class TinyZImageQwen3Loader:
    """Test node: Z-Image's tiny Qwen3 text encoder as a CLIP, in place of CLIPLoader type 'lumina2' (Qwen3 file)."""

    @classmethod
    def INPUT_TYPES(cls):
        return seed_input(2560)

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "PipeTrainer/tests"
    DESCRIPTION = "Test only: a Qwen3-shaped text encoder (Z-Image's) at hidden 40, with seeded weights."

    def load(self, seed: int):
        import folder_paths

        return (tiny_zimage_qwen3_clip(seed, folder_paths.get_folder_paths("embeddings")),)


NODE_CLASS_MAPPINGS = {"PipeTrainerTestTinyZImageQwen3Loader": TinyZImageQwen3Loader}
NODE_DISPLAY_NAME_MAPPINGS = {"PipeTrainerTestTinyZImageQwen3Loader": "Tiny Qwen3 Loader, Z-Image (test)"}

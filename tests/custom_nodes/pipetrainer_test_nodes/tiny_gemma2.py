"""A tiny Gemma 2 text encoder, Lumina 2's (``CLIPLoader`` type ``lumina2``), from ComfyUI's own classes.

ComfyUI's ``comfy.text_encoders.lumina2``: ``LuminaTokenizer`` / ``Gemma2BTokenizer`` (SentencePiece,
BOS added, no end token, no padding to a length) and ``te(model_type="gemma2_2b")`` with its
``Gemma2_2BModel`` (``llama.Gemma2_2B``: the second-to-last hidden state, attention masks returned),
where only the transformer's size is tiny (:mod:`.tiny_llm`): hidden 24 (the width of the Lumina 2
fixture in tests/family_rows/lumina2.py; the real model's is 2304), 3 layers, one attention head of
Gemma's real head width 256.

Gemma's SentencePiece model is not shipped with ComfyUI: it travels inside the real weights file as
``spiece_model`` (ComfyUI's loader moves it into ``tokenizer_data``). This builds one in the same id
layout as Gemma's (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, control tokens up to 105,
``<start_of_turn>`` 106 and ``<end_of_turn>`` 107, byte fallback), trained on a fixed text with
SentencePiece's own trainer (deterministic, ~20 ms), and hands it to ComfyUI's tokenizer the same way.
"""

from __future__ import annotations

import io

from .tiny_llm import build_clip, seed_input, with_clip_model, with_config

HIDDEN = 24
TINY_GEMMA2_CONFIG = {"vocab_size": 420, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
                      "num_hidden_layers": 3, "num_attention_heads": 1, "num_key_value_heads": 1}
_TRAINING_TEXT = (
    "You are an assistant designed to generate superior images with the superior degree of image-text "
    "alignment based on textual prompts or user prompts.",
    "You are an assistant designed to generate high-quality images with the highest degree of image-text "
    "alignment based on textual prompts.",
    "a photo of a cat sitting on a red chair in the sun, the quick brown fox jumps over the lazy dog",
    "0123456789 <Prompt Start> portrait, landscape, painting, sketch, bright colours",
)


def spiece_model() -> bytes:
    """A serialized SentencePiece model in Gemma's id layout (deterministic)."""
    import sentencepiece

    buffer = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_TRAINING_TEXT * 3), model_writer=buffer, model_type="bpe",
        vocab_size=TINY_GEMMA2_CONFIG["vocab_size"], hard_vocab_limit=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        control_symbols=["<mask>", "[@BOS@]"] + [f"<unused{i}>" for i in range(100)],
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], byte_fallback=True, character_coverage=1.0,
        split_digits=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", num_threads=1, minloglevel=2)
    return buffer.getvalue()


def tiny_gemma2_clip(seed: int = 2304, embedding_directory=None):
    """A ``comfy.sd.CLIP`` as CLIPLoader type ``lumina2`` makes it, Gemma-2-shaped at hidden 24."""
    import comfy.text_encoders.lumina2 as lumina2
    import torch

    model = with_config(lumina2.Gemma2_2BModel, TINY_GEMMA2_CONFIG)
    te = with_clip_model(lumina2.te(model_type="gemma2_2b"), model)
    spiece = torch.ByteTensor(list(spiece_model()))  # as ComfyUI's loader hands it on: a uint8 tensor
    return build_clip(te, lumina2.LuminaTokenizer, seed, norm_center=0.0,  # Gemma's RMSNorm adds 1 itself
                      tokenizer_data={"spiece_model": spiece}, embedding_directory=embedding_directory)


class TinyGemma2Loader:
    """Test node: the tiny Gemma 2 text encoder as a CLIP, in place of CLIPLoader type 'lumina2'."""

    @classmethod
    def INPUT_TYPES(cls):
        return seed_input(2304)

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "PipeTrainer/tests"
    DESCRIPTION = "Test only: a Gemma-2-shaped text encoder (Lumina 2's) at hidden 24, with seeded weights."

    def load(self, seed: int):
        import folder_paths

        return (tiny_gemma2_clip(seed, folder_paths.get_folder_paths("embeddings")),)


NODE_CLASS_MAPPINGS = {"PipeTrainerTestTinyGemma2Loader": TinyGemma2Loader}
NODE_DISPLAY_NAME_MAPPINGS = {"PipeTrainerTestTinyGemma2Loader": "Tiny Gemma 2 Loader (test)"}

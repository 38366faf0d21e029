"""A tiny Mistral 3 text encoder, FLUX.2 dev's (``CLIPLoader`` type ``flux2``), from ComfyUI's own classes.

ComfyUI's ``comfy.text_encoders.flux``: ``Flux2Tokenizer`` / ``Mistral3Tokenizer`` (the system-prompt
template around the caption, left padding, start token 1, pad 11) and ``flux2_te()`` with its
``Mistral3_24BModel`` (hidden states 10, 20 and 30 stacked by ``Flux2TEModel`` into one ``3 x hidden``
wide cond), where only the transformer's size is tiny (:mod:`.tiny_llm`): hidden 8 (cond width 24),
31 layers (index 30 stays inside the stack, as in the real 40), one head of Mistral's head width 128.

Mistral's tokenizer is not shipped with ComfyUI: a "tekken" vocabulary travels inside the real weights
file as ``tekken_model`` (ComfyUI's loader moves it into ``tokenizer_data``). This builds a tekken
vocabulary in the real layout: the first 20 special tokens of Mistral Small 3 at their real ranks
(``<s>`` 1, ``[INST]`` 3, ``<pad>`` 11, ``[SYSTEM_PROMPT]`` 17, ...) and the 256 single bytes (byte-level
BPE without merges), and hands it to ComfyUI's tokenizer the same way.

ComfyUI's Mistral tokenizer depends on transformers internals that changed (see
:func:`mistral_tokenizer_problem`, which says whether this host and transformers can build it).
"""

from __future__ import annotations

import base64
import json

from .tiny_llm import build_clip, seed_input, with_clip_model, with_config

HIDDEN = 8
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                  "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]")
VOCAB = len(SPECIAL_TOKENS) + 256
TINY_MISTRAL3_CONFIG = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
                        "num_hidden_layers": 31, "num_attention_heads": 1, "num_key_value_heads": 1}
_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
            r"\s*[\r\n]+|\s+(?!\S)|\s+")


def tekken_model() -> bytes:
    """A tekken vocabulary (JSON) in Mistral's layout: specials at their real ranks, then the 256 bytes."""
    data = {
        "config": {"pattern": _PATTERN, "num_vocab_tokens": VOCAB, "default_vocab_size": VOCAB,
                   "default_num_special_tokens": len(SPECIAL_TOKENS), "version": "v7"},
        "vocab": [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": None}
                  for i in range(256)],
        "special_tokens": [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(SPECIAL_TOKENS)],
    }
    return json.dumps(data).encode()


def mistral_tokenizer_problem() -> str | None:
    """Why ComfyUI cannot build FLUX.2 dev's tokenizer with this transformers (None: it can).

    Seen: transformers >= 5.15 changed ``MistralConverter`` to take a file (TypeError on every ComfyUI
    up to the v0.28 snapshot); on ComfyUI 0.3.75 transformers 5 also gives no start token for an empty
    text (IndexError in ``SDTokenizer``; later ComfyUI passes ``start_token=1``). Works: ComfyUI 0.3.75
    with transformers 4.57, current ComfyUI with transformers 5.14.
    """
    import comfy.text_encoders.flux as flux
    import transformers

    try:
        flux.Flux2Tokenizer(tokenizer_data={"tekken_model": tekken_model()})
    except (TypeError, IndexError) as exc:
        return (f"ComfyUI's FLUX.2 Mistral tokenizer cannot be built with transformers {transformers.__version__} "
                f"({type(exc).__name__}: {exc}); ComfyUI 0.3.75 needs transformers 4.x, later ComfyUI transformers "
                "<= 5.14 or Comfy-Org/ComfyUI#15503")
    return None


def tiny_mistral_clip(seed: int = 15360, embedding_directory=None):
    """A ``comfy.sd.CLIP`` as CLIPLoader type ``flux2`` makes FLUX.2 dev's, Mistral-3-shaped at hidden 8."""
    import comfy.text_encoders.flux as flux
    import torch

    problem = mistral_tokenizer_problem()
    if problem:
        raise RuntimeError(problem)
    model = with_config(flux.Mistral3_24BModel, TINY_MISTRAL3_CONFIG)
    te = with_clip_model(flux.flux2_te(), model)
    tekken = torch.ByteTensor(list(tekken_model()))  # as ComfyUI's loader hands it on: a uint8 tensor
    return build_clip(te, flux.Flux2Tokenizer, seed, norm_center=1.0, tokenizer_data={"tekken_model": tekken},
                      embedding_directory=embedding_directory)


class TinyMistralLoader:
    """Test node: FLUX.2 dev's tiny Mistral 3 text encoder as a CLIP, in place of CLIPLoader type 'flux2'."""

    @classmethod
    def INPUT_TYPES(cls):
        return seed_input(15360)

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "PipeTrainer/tests"
    DESCRIPTION = "Test only: a Mistral-3-shaped text encoder (FLUX.2 dev's) at hidden 8, with seeded weights."

    def load(self, seed: int):
        import folder_paths

        return (tiny_mistral_clip(seed, folder_paths.get_folder_paths("embeddings")),)


NODE_CLASS_MAPPINGS = {"PipeTrainerTestTinyMistralLoader": TinyMistralLoader}
NODE_DISPLAY_NAME_MAPPINGS = {"PipeTrainerTestTinyMistralLoader": "Tiny Mistral 3 Loader, FLUX.2 dev (test)"}

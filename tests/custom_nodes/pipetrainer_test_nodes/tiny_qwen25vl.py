"""A tiny Qwen2.5-VL text encoder (language model + vision tower) built from ComfyUI's own classes.

Qwen-Image and Qwen-Image-Edit take Qwen2.5-VL-7B's hidden states (3584 wide); ComfyUI's loader builds
that model from fixed dataclass defaults (8 B parameters with its 1280-wide, 32-block vision tower), so
no small file can load through ``CLIPLoader``. This builds the same ``comfy.sd.CLIP`` ComfyUI builds for
``qwen_image`` (tokenizer ``comfy.text_encoders.qwen_image.QwenImageTokenizer`` with the Qwen2 tokenizer
ComfyUI ships; text model ``QwenImageTEModel`` driving ``llama.Qwen25_7BVLI``) with a small config:
hidden 32 (the width of the tiny Qwen-Image in tests/family_rows/qwen_image.py), one decoder layer, one
attention head (ComfyUI fixes the head width at 128 and the 3-axis rotary split at 16/24/24), and a
vision tower of ComfyUI's ``qwen_vl.Qwen2VLVisionTransformer`` class 32 wide with two blocks (ComfyUI
builds it 1280 wide, so the one line that makes it is the one thing not inherited). The token embedding
keeps the real vocabulary (the shipped tokenizer's ids reach 151 655), so most of the 5.0 M parameters
are that table. ComfyUI's own ``TextEncodeQwenImageEdit(Plus)`` nodes encode images and text with it
exactly as with the real model: the image patches go through the vision tower into the prompt's
``<|image_pad|>`` slot, with the 3-axis rotary positions of Qwen2.5-VL.
"""

from __future__ import annotations

from .tiny_llm import build_clip, seed_input

TINY_QWEN25VL_CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
}
# Windows of 32 x 32 patches (ComfyUI's 8 x 8): the same code path with few attention calls, which dominate on CPU.
TINY_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_layers": 2, "window_size": 448}


def _classes():
    """ComfyUI's classes, imported when called (ComfyUI is importable only inside its process)."""
    import torch
    from comfy import sd1_clip
    from comfy.text_encoders import llama, qwen_image, qwen_vl

    class TinyQwen25VLI(llama.Qwen25_7BVLI):
        """ComfyUI's Qwen2.5-VL with a narrow vision tower; preprocessing and forward are ComfyUI's."""

        def __init__(self, config_dict, dtype, device, operations):
            torch.nn.Module.__init__(self)
            config = llama.Qwen25_7BVLI_Config(**config_dict)
            self.num_layers = config.num_hidden_layers
            self.model = llama.Llama2_(config, device=device, dtype=dtype, ops=operations)
            self.visual = qwen_vl.Qwen2VLVisionTransformer(output_hidden_size=config.hidden_size, device=device,
                                                           dtype=dtype, ops=operations, **TINY_VISION)
            self.dtype = dtype

    class TinyQwen25VLModel(sd1_clip.SDClipModel):
        """As ComfyUI's ``Qwen25_7BVLIModel``, with the tiny config."""

        def __init__(self, device="cpu", layer="last", layer_idx=None, dtype=None, attention_mask=True,
                     model_options={}):  # noqa: B006
            super().__init__(device=device, layer=layer, layer_idx=layer_idx,
                             textmodel_json_config=dict(TINY_QWEN25VL_CONFIG), dtype=dtype,
                             special_tokens={"pad": 151643}, layer_norm_hidden_state=False, model_class=TinyQwen25VLI,
                             enable_attention_masks=attention_mask, return_attention_masks=attention_mask,
                             model_options=model_options)

    class TinyQwenImageTEModel(qwen_image.QwenImageTEModel):
        """ComfyUI's Qwen-Image text encoder (its template cut and mask handling) over the tiny model."""

        def __init__(self, device="cpu", dtype=None, model_options={}):  # noqa: B006
            sd1_clip.SD1ClipModel.__init__(self, device=device, dtype=dtype, name="qwen25_7b",
                                           clip_model=TinyQwen25VLModel, model_options=model_options)

    return TinyQwenImageTEModel, qwen_image.QwenImageTokenizer


def tiny_qwen25vl_clip(seed: int = 3584, embedding_directory=None):
    """A ``comfy.sd.CLIP`` of ComfyUI's Qwen-Image text encoder at width 32, with seeded weights."""
    model_class, tokenizer_class = _classes()
    return build_clip(model_class, tokenizer_class, seed, norm_center=1.0, embedding_directory=embedding_directory)


class TinyQwen25VLLoader:
    """Test node: the tiny Qwen2.5-VL text encoder as a CLIP, in place of CLIPLoader type 'qwen_image'."""

    @classmethod
    def INPUT_TYPES(cls):
        return seed_input(3584)

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "PipeTrainer/tests"
    DESCRIPTION = ("Test only: a 5 M-parameter Qwen2.5-VL (32 wide, with a vision tower) for Qwen-Image(-Edit), "
                   "seeded weights.")

    def load(self, seed: int):
        import folder_paths

        return (tiny_qwen25vl_clip(seed, folder_paths.get_folder_paths("embeddings")),)


NODE_CLASS_MAPPINGS = {"PipeTrainerTestTinyQwen25VLLoader": TinyQwen25VLLoader}
NODE_DISPLAY_NAME_MAPPINGS = {"PipeTrainerTestTinyQwen25VLLoader": "Tiny Qwen2.5-VL Loader (test)"}

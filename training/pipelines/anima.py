"""Anima (``comfy.ldm.anima.model.Anima``, ``model_base.Anima``) as pipeline stage layers.

Why a family of its own: Anima is a Cosmos Predict2 DiT (training/pipelines/cosmos_predict2.py, whose block and
final layers it reuses unchanged) with an LLM adapter in front of the text: Qwen3 0.6B's states (1024 wide) are
cross-attended by T5 token embeddings of the same caption (``LLMAdapter``: 6 transformer blocks), the result
is scaled by the T5 token weights and zero-padded to 512 tokens (``Anima.preprocess_text_embeds``), and that is
the DiT's cross-attention context. Its sampling is plain flow matching, unlike Cosmos Predict2's.

Stage tuples: Cosmos Predict2's, except the embed's inputs:
``(x [B, 16, T, H, W], timestep [B], cond [B, N, 1024], mask [B, N], ids [B, M], weights [B, M])`` -> Cosmos
Predict2's embed tuple with the adapted context. ComfyUI runs each prompt through the adapter on its own
(never batching prompts of different lengths), so the embed does too: example ``i`` uses its own ``N_i`` Qwen
states (``max(1, mask sum)``: the Qwen tokenizer pads only an empty prompt, to one masked token) and its own
``M_i`` T5 ids (up to the last non-zero id: the T5 tokenizer ends every prompt with its end token 1 and never
emits the pad id 0 inside), through ComfyUI's own ``preprocess_text_embeds``; the results (512 tokens each,
longer for longer prompts) are zero-padded to the longest, as ComfyUI pads to 512.

Text conditioning: ComfyUI's ``Anima.extra_conds`` runs the adapter at sampling (inference mode) and, outside
inference mode, hands ``t5xxl_ids`` / ``t5xxl_weights`` to the model's forward, which runs it: the same
function either way. The cache stores the ids and weights the Anima text encoder puts into the conditioning
(training/cache/encoders.py) and the Qwen attention mask; ragged ids are zero-padded per micro-batch
(training/data/micro_batches.py). A cache made without them is refused by preflight, naming them.

Loss. ``model_base.Anima`` is ``ModelType.FLOW``: ComfyUI's ``ModelSamplingDiscreteFlow`` with the config's shift
3 and multiplier 1, the CONST target ``noise - x0`` (training/objective; a ModelSamplingAuraFlow / SD3 node
before Train LoRA is replayed as on the other flow families).

LoRA targets: the DiT's blocks, as on Cosmos Predict2 (the adapter's ``llm_adapter.blocks`` are not targeted:
the presets full-match ``blocks.N.`` from the model's root). Backward: the same comfy_kitchen op backward as
Cosmos Predict2.

Refused by name: an Anima diffusion model that is not ComfyUI's ``Anima`` class, and an image-to-video layout
(``in_channels`` other than ``out_channels``; ComfyUI's detection builds none).

Fixture tier: detection pins width 2048 and a fixed 1024-wide adapter with a 32128-token embedding (about
100 M parameters in the adapter alone), so the tests build ComfyUI's ``Anima`` config class at width 16 in
memory and put in ComfyUI's own ``LLMAdapter`` at width 16, one layer (tests/family_rows/cosmos_predict2.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .base import Batch, ExtraSpec, StageLayer, refuse_unsupported, register
from .cosmos_predict2 import CosmosEmbed, CosmosFinal, CosmosPredict2Adapter, block_layers, enable_backward
from .options import NoOptions

FAMILY = "Anima"
TEXT_MASK = "attention_mask"
T5_IDS, T5_WEIGHTS = "t5xxl_ids", "t5xxl_weights"


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.anima.model import Anima

    if not isinstance(dm, Anima):
        return f"{type(dm).__name__} is not ComfyUI's Anima model; the {FAMILY} adapter cannot train it."
    if int(dm.in_channels) != int(dm.out_channels):
        return (f"This Anima model takes {dm.in_channels} latent channels (an image-to-video layout): its extra "
                "conditioning channels are not implemented. Anima text-to-image models train.")
    return None


class AnimaEmbed(CosmosEmbed):
    """Cosmos Predict2's embed, with the context from ComfyUI's LLM adapter, one prompt at a time."""

    def __init__(self, dm: nn.Module):
        from comfy.ldm.anima.model import Anima

        super().__init__(dm)
        self.adopt_same(dm, "llm_adapter")
        self._preprocess = Anima.preprocess_text_embeds

    def text_context(self, inputs) -> torch.Tensor:
        cond, mask, ids, weights = inputs[2:6]
        out = []
        for i in range(cond.shape[0]):
            n = max(1, int(mask[i].sum()))
            nonzero = ids[i].nonzero()
            m = int(nonzero.max()) + 1 if len(nonzero) else ids.shape[1]
            out.append(self._preprocess(self, cond[i:i + 1, :n], ids[i:i + 1, :m],
                                        t5xxl_weights=weights[i:i + 1, :m, None].to(cond.dtype)))
        length = max(o.shape[1] for o in out)
        return torch.cat([torch.nn.functional.pad(o, (0, 0, 0, length - o.shape[1])) for o in out])


class AnimaAdapter(CosmosPredict2Adapter):
    name = FAMILY
    options_type = NoOptions  # no image-to-video layout (refused above), so no first_frame_clean
    text_extras = {T5_IDS: False, T5_WEIGHTS: False}  # kept by the cache (text_extras.py): unbatched
    text_encoder = "Anima's Qwen3 0.6B text encoder (CLIPLoader type stable_diffusion, as ComfyUI's template)"

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        refuse_unsupported(self, diffusion_model)
        enable_backward()
        return [AnimaEmbed(diffusion_model), *block_layers(diffusion_model), CosmosFinal(diffusion_model)]

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(1024, 0)``: Qwen3 0.6B's states, which the LLM adapter's cross-attention reads."""
        return int(diffusion_model.llm_adapter.blocks[0].cross_attn.k_proj.in_features), 0

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        return {
            TEXT_MASK: ExtraSpec(shape=("T",), source="text", follows_text=True,
                                 description="the Qwen3 text attention mask (the prompt's own token count)"),
            T5_IDS: ExtraSpec(shape=("*",), source="text", description="the caption's T5 token ids (LLM adapter)"),
            T5_WEIGHTS: ExtraSpec(shape=("*",), source="text", description="the caption's T5 token weights"),
        }

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        missing = [name for name in (TEXT_MASK, T5_IDS, T5_WEIGHTS) if name not in batch.extras]
        if batch.cond is None or missing:
            raise ValueError(f"Anima needs the text encoder's states, attention mask and T5 token ids and weights "
                             f"(missing: {', '.join(missing) or 'cond'}): cache the dataset with {self.text_encoder}.")
        return (batch.noisy, batch.timestep, batch.cond, batch.extras[TEXT_MASK].to(torch.int64),
                batch.extras[T5_IDS].to(torch.int64), batch.extras[T5_WEIGHTS])


ADAPTER = register(AnimaAdapter(), model_classes=("Anima",))

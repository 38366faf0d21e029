"""HiDream I1 (``comfy.ldm.hidream.model.HiDreamImageTransformer2DModel``, ``model_base.HiDream``) as pipeline stage layers.

Why a family of its own: HiDream I1 (full, dev and fast share one network and one ComfyUI class) is a
Flux-like double-then-single stream DiT with a different data flow: every block reads its own Llama 3.1
hidden layer (``caption_projection[i]`` of ``llama_layers[i]``) appended to the text tokens it carries
(the T5 states and the last Llama layer, projected), the MLPs of the image stream are mixtures of experts
(a softmax gate picks the top-k routed SwiGLU experts per token, plus a shared expert), and the
modulation reads time plus the pooled CLIP-L/G vector. No other family's layers fit.

Stage tuples (``B`` batch; ``S`` T5 tokens; ``L`` Llama tokens; ``N`` image patches; ``F`` the width;
``E`` the Llama layers of the encoder, ``[B, E, L, 4096]`` as ComfyUI carries them):

- embed: ``(x [B, 16, H, W], timestep [B], context [B, S, 4096], pooled [B, 2048], llama [B, E, L, 4096])``
  -> ``(img [B, N, F], txt [B, S+L, F], llama, last [B, L, F], adaln [B, F], meta)``: ComfyUI's own
  ``pad_to_patch_size``, ``expand_timesteps``, ``t_embedder`` + ``p_embedder``, ``patchify``, ``x_embedder``;
  ``txt`` is the projected T5 states and the projected last Llama layer (``last``), as ``_forward`` builds
  the initial text tokens;
- each double block: ``(img, txt, [llama], last, adaln, meta)``; block ``i`` appends its own projected Llama
  layer to ``txt`` and keeps the first ``S+L`` text tokens of the result, as ``_forward`` does; the last
  double block joins ``hidden = [img, txt]``;
- each single block: ``(hidden, [llama], last, adaln, meta)``, its Llama layer appended and cut off again;
  the last block gives ``(img, adaln, meta)`` (image tokens only);
- final: ComfyUI's ``final_layer``, ``unpatchify``, crop and sign (``_forward`` returns ``-output``).

The last block's Llama layer is the one the embed stage projected for the initial text (``last``): it is
projected once, by one module, and handed on, so no module lives in two stages; the raw ``llama`` stack is
dropped before the last block, which reads nothing else of it. Each block adopts its ``caption_projection``
and recomputes the parameter-free rotary table (``pe_embedder``) from ``meta`` (int64 ``h, w, pH, pW``).

MoE. ``MOEFeedForwardSwiGLU.forward`` (the path ComfyUI always takes) has a backward: tokens are routed by
``topk`` indices (no gradient, as in any top-k MoE), expert outputs are scattered into a new tensor and
weighed by the softmax gate scores, which carry the gradient to the inputs. The gate is a bare Parameter
(not a Linear), so it gets no LoRA; the experts' Linears do (``attention_mlp``). No auxiliary
load-balancing loss exists in ComfyUI's gate (``aux_loss`` is None), so none is added.

Loss. ``model_base.HiDream`` is ``ModelType.FLOW``: ComfyUI's ``ModelSamplingDiscreteFlow`` with the config's
shift (ComfyUI's ``HiDream`` config leaves it 1.0; a ModelSamplingSD3 node before Train LoRA, as HiDream
workflows use with shift 3 to 6, is replayed) and the CONST target; training/objective takes both from the
model. The network sees ``sigma x 1000``, as ComfyUI passes it.

Text: ComfyUI's HiDream text encoder (QuadrupleCLIPLoader: CLIP-L, CLIP-G, T5-XXL, Llama 3.1 8B) gives the
T5 states as the cond (128 tokens), the pooled CLIP-L + CLIP-G vector (2048) as ``y``, and every Llama layer
as ``conditioning_llama3`` (``extra_conds`` hands it as ``encoder_hidden_states_llama3``), which the cache
keeps as a text extra ``[E, L, 4096]``. No text mask reaches the model. The Llama tokenizer pads every
caption to 128 tokens; a caption of more Llama tokens shares a micro-batch with any other: the shorter Llama
stacks get zero tokens appended, as every family's shorter conds do (training/data/micro_batches.py). The cached Llama stack is large (``E x L x 4096`` floats a caption).

Text-to-image only: ``image_cond`` (HiDream E1's edit image, concatenated along the width) is not taken.

Not registered: ComfyUI's ``HiDreamO1`` (HiDream-O1-Image), so PipeTrainer says it cannot train it. It is a
pixel-space Qwen3-VL decoder over one text and image sequence with token ids (no VAE latent, no text states to
cache), and its flow scales the noise (``noise_scale`` 8), which the shared objective's velocity target does
not follow: claiming the class would make it look trainable. Refused by name: a model whose ``llama_layers``
do not match its blocks one to one (ComfyUI's forward would index the projections past their end), or with
no blocks.

Fixture tier: detection pins 20 heads of 128, 4096-wide text and 48 blocks (17 B parameters), so the tests
build a tiny model in memory from ComfyUI's own ``HiDream`` config class (tests/family_rows/hidream.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .base import Batch, ExtraSpec, Geometry, StageLayer, refuse_model_class, refuse_unsupported, register
from .options import NoOptions
from .out_of_place import OutOfPlaceResidualAdds
from .presets import ai_toolkit

FAMILY = "HiDream"
LLAMA = "conditioning_llama3"  # the text encoder's cond key; model_base.HiDream hands it as encoder_hidden_states_llama3
_ATTENTION = r"attn1\.to_(q|k|v|out)(_t)?"
_MLP = r"ff_(i|t)\.((shared_experts|experts\.\d+)\.)?w[123]"
_MODULATION = r"adaLN_modulation\.1"
_TARGETS = {
    "attention": _ATTENTION,
    "attention_mlp": rf"{_ATTENTION}|{_MLP}",
    "all_linear": rf"{_ATTENTION}|{_MLP}|{_MODULATION}",
}


def _support_problem(dm: nn.Module) -> str | None:
    from comfy.ldm.hidream.model import HiDreamImageTransformer2DModel

    if not isinstance(dm, HiDreamImageTransformer2DModel):
        return f"{type(dm).__name__} is not a HiDream I1 transformer; the {FAMILY} adapter cannot train it."
    blocks = len(dm.double_stream_blocks) + len(dm.single_stream_blocks)
    if blocks == 0:
        return "This HiDream model has no transformer blocks; nothing to train."
    if len(dm.llama_layers or ()) != blocks:
        return (f"This HiDream model reads {len(dm.llama_layers or ())} Llama layers for {blocks} blocks; ComfyUI's "
                "forward projects one Llama layer per block, so this adapter cannot build it.")
    return None


def _is_i1(dm: nn.Module) -> bool:
    """A HiDream I1 network (preflight reads a refused relative's dims before its refusal: it gets none)."""
    return hasattr(dm, "caption_projection") and hasattr(dm, "p_embedder")


def _rope(pe_embedder: nn.Module, meta: torch.Tensor, batch: int, txt_len: int) -> torch.Tensor:
    """The rotary table of ``_forward``: image positions ``(0, row, col)``, text positions 0."""
    ph, pw = int(meta[2]), int(meta[3])
    device = meta.device
    img_ids = torch.zeros(ph, pw, 3, device=device)
    img_ids[..., 1] = img_ids[..., 1] + torch.arange(ph, device=device)[:, None]
    img_ids[..., 2] = img_ids[..., 2] + torch.arange(pw, device=device)[None, :]
    img_ids = img_ids.reshape(1, ph * pw, 3).expand(batch, -1, -1)
    txt_ids = torch.zeros(batch, txt_len, 3, device=device, dtype=img_ids.dtype)
    return pe_embedder(torch.cat((img_ids, txt_ids), dim=1))


class HiDreamEmbed(StageLayer):
    """Time + pooled modulation input, patch embedding, the projected T5 and last Llama layer."""

    def __init__(self, dm: nn.Module, keep_llama: bool):
        super().__init__()
        self.adopt_same(dm, "t_embedder", "p_embedder", "x_embedder")
        last = len(dm.llama_layers) - 1
        self.adopt("t5_projection", dm.caption_projection[-1], f"caption_projection.{len(dm.caption_projection) - 1}")
        self.adopt("last_projection", dm.caption_projection[last], f"caption_projection.{last}")
        self.last_layer_index = dm.llama_layers[last]
        self.patch_size, self.max_seq, self.keep_llama = dm.patch_size, dm.max_seq, keep_llama
        self._patchify = type(dm).patchify
        self._expand_timesteps = type(dm).expand_timesteps

    def forward(self, inputs):
        from comfy.ldm.common_dit import pad_to_patch_size

        x, timestep, context, pooled, llama = inputs
        h, w = x.shape[-2:]
        hidden = pad_to_patch_size(x, (self.patch_size, self.patch_size))
        batch = hidden.shape[0]
        t = self._expand_timesteps(self, timestep, batch, hidden.device)
        adaln = self.t_embedder(t, hidden.dtype) + self.p_embedder(pooled)
        img, masks, img_sizes = self._patchify(self, hidden, self.max_seq)
        if masks is not None:
            raise ValueError("HiDream's patchify gave token masks; only whole latents are supported.")
        img = self.x_embedder(img)
        width = img.shape[-1]
        last = self.last_projection(llama[:, self.last_layer_index]).view(batch, -1, width)
        txt = torch.cat((self.t5_projection(context).view(batch, -1, width), last), dim=1)
        ph, pw = img_sizes[0]
        meta = torch.tensor([h, w, ph, pw], dtype=torch.int64, device=x.device)
        if self.keep_llama:
            return img, txt, llama, last, adaln, meta
        return img, txt, last, adaln, meta


class HiDreamBlock(StageLayer):
    """One double or single stream block with its own Llama layer projected and appended to the text."""

    swappable = True

    def __init__(self, dm: nn.Module, index: int):
        super().__init__()
        n_double = len(dm.double_stream_blocks)
        self.count = n_double + len(dm.single_stream_blocks)
        self.index, self.double = index, index < n_double
        if self.double:
            self.adopt("block", dm.double_stream_blocks[index], f"double_stream_blocks.{index}")
        else:
            self.adopt("block", dm.single_stream_blocks[index - n_double], f"single_stream_blocks.{index - n_double}")
        self.last_block = index == self.count - 1
        self.last_double = self.double and index == n_double - 1
        self.reads_llama = not self.last_block  # the last block's Llama layer comes projected from the embed stage
        self.sends_llama = index < self.count - 2
        if self.reads_llama:
            self.adopt("projection", dm.caption_projection[index], f"caption_projection.{index}")
            self.layer_index = dm.llama_layers[index]
        self.pe_embedder = dm.pe_embedder  # parameter-free

    def forward(self, inputs):
        if self.double:
            img, txt, *rest = inputs
        else:
            hidden, *rest = inputs
        if self.reads_llama:
            llama, last, adaln, meta = rest
        else:
            last, adaln, meta = rest
        batch = adaln.shape[0]
        own = last if self.last_block else self.projection(llama[:, self.layer_index]).view(batch, -1, last.shape[-1])
        n_img = int(meta[2]) * int(meta[3])
        if self.double:
            joined = torch.cat((txt, own), dim=1)
            rope = _rope(self.pe_embedder, meta, batch, joined.shape[1])
            with OutOfPlaceResidualAdds(img, joined):
                img, joined = self.block(image_tokens=img, image_tokens_masks=None, text_tokens=joined,
                                         adaln_input=adaln, rope=rope, transformer_options={})
            txt = joined[:, :txt.shape[1]]
            if self.last_block:
                return img, adaln, meta
            if self.last_double:
                out = (torch.cat((img, txt), dim=1),)
            else:
                out = (img, txt)
        else:
            joined = torch.cat((hidden, own), dim=1)
            rope = _rope(self.pe_embedder, meta, batch, joined.shape[1] - n_img)
            with OutOfPlaceResidualAdds(joined):
                joined = self.block(image_tokens=joined, image_tokens_masks=None, text_tokens=None,
                                    adaln_input=adaln, rope=rope, transformer_options={})
            if self.last_block:
                return joined[:, :n_img], adaln, meta
            out = (joined[:, :hidden.shape[1]],)
        if self.sends_llama:
            return (*out, llama, last, adaln, meta)
        return (*out, last, adaln, meta)


class HiDreamFinal(StageLayer):
    """ComfyUI's ``final_layer`` and ``unpatchify``, cropped, with ``_forward``'s sign."""

    def __init__(self, dm: nn.Module):
        super().__init__()
        self.adopt_same(dm, "final_layer")
        self.patch_size = dm.patch_size
        self._unpatchify = type(dm).unpatchify

    def forward(self, inputs):
        img, adaln, meta = inputs
        h, w, ph, pw = (int(v) for v in meta)
        out = self.final_layer(img, adaln)
        out = self._unpatchify(self, out, [[ph, pw]] * out.shape[0])
        return -out[:, :, :h, :w]


class HiDreamAdapter:
    name = FAMILY
    options_type = NoOptions
    presets = (ai_toolkit("HiDream, 48 GB", "train_lora_hidream_48", 32, lr=2e-4),)
    text_extras = {LLAMA: True}  # kept by the cache (text_extras.py)

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        problem = _support_problem(diffusion_model)
        return [problem] if problem else []

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        dm = diffusion_model
        refuse_unsupported(self, dm)
        n = len(dm.double_stream_blocks) + len(dm.single_stream_blocks)
        return [HiDreamEmbed(dm, keep_llama=n > 1), *(HiDreamBlock(dm, i) for i in range(n)), HiDreamFinal(dm)]

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        n = len(diffusion_model.double_stream_blocks) + len(diffusion_model.single_stream_blocks)
        return [False, *([HiDreamBlock.swappable] * n), False]

    def lora_target_regex(self, preset: str) -> str:
        return rf"(double|single)_stream_blocks\.\d+\.block\.({_TARGETS[preset]})"

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        if not _is_i1(diffusion_model):
            return Geometry()
        p = int(diffusion_model.patch_size)
        return Geometry(patch=(1, p, p))

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(4096, 2048)`` on HiDream I1: T5-XXL states and the pooled CLIP-L + CLIP-G vector."""
        dm = diffusion_model
        if not _is_i1(dm):
            return 0, 0
        return int(dm.caption_projection[-1].linear.in_features), int(dm.p_embedder.pooled_embedder.linear_1.in_features)

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        if not _is_i1(diffusion_model):
            return {}
        width = int(diffusion_model.caption_projection[0].linear.in_features)
        return {LLAMA: ExtraSpec(shape=("*", "*", width), source="text",
                                 description="every Llama 3.1 hidden layer of the caption (conditioning_llama3)")}

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        p = int(getattr(diffusion_model, "patch_size", 1))
        return math.prod(-(-int(s) // p) for s in latent_shape[-2:])

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        llama = batch.extras.get(LLAMA)
        if batch.cond is None or batch.pooled is None or llama is None:
            raise ValueError("HiDream needs the T5 states, the pooled CLIP vector and the Llama layers, and the cache "
                             "lacks some: cache the dataset with HiDream's text encoder (QuadrupleCLIPLoader: CLIP-L, "
                             "CLIP-G, T5-XXL, Llama 3.1).")
        return batch.noisy, batch.timestep, batch.cond, batch.pooled, llama

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        return None

    def text_length(self, lengths: Sequence[int]) -> int:
        """The longest cond of the micro-batch (T5 gives 128 tokens to every caption); nothing is cut."""
        return max(lengths)


ADAPTER = register(HiDreamAdapter(), model_classes=("HiDream",))
refuse_model_class("HiDreamO1", "HiDream-O1 is a pixel-space Qwen3-VL decoder over text and image token ids (no VAE "
                   "latent, no text states to cache), and its flow scales the noise, which PipeTrainer's objective "
                   "does not follow. HiDream I1 (Full, Dev, Fast) trains.")

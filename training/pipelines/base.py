"""The contract every model family implements, and the registry that finds the family of a model.

A family adapter turns ComfyUI's diffusion model into an ordered list of stage layers for DeepSpeed's
pipeline (each takes and returns a flat tuple of tensors), and says everything else that differs by
family: which Linears get LoRA (as a regex over ComfyUI module paths, decided by
:mod:`.targets`), the latent geometry (patch sizes, video or image, frame rule), the conditioning it
takes (text width, pooled width, named extras with their shapes), how the first stage's inputs are
built from a :class:`Batch`, and an optional loss mask. Noise, timesteps, the loss target (from
ComfyUI's ``model_sampling``) and LoRA files are shared and live outside.

Registry. Each family module registers its adapter when it is imported, with one call::

    ADAPTER = register(WanAdapter(), model_classes=("WAN21",))

A class named in ``model_classes`` claims its subclasses too (``WAN22`` is a ``WAN21``); one named in
``exact_classes`` only itself. ComfyUI builds SD 1.x / 2.x as ``model_base.BaseModel``, the base class of
every other model class, so that family registers it exactly: a refiner or Stable Zero123 stay unknown instead
of being taken for SD 1.x.

The first lookup (:func:`family_name_for`, :func:`adapter_for`, :func:`known_families`) imports every
module of this package once, so adding a family is adding one module: there is no central list to
edit, and nothing is imported before a family is asked for. A family module does nothing at import
but define classes and make that call. Modules that define no family (this one, ``options``,
``targets``...) register nothing. An import error in a family module is raised, never skipped: a
silently missing family would only show up as "cannot train this model".
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn


class StageLayer(nn.Module):
    """A pipeline layer that reuses modules of the ComfyUI model.

    ``comfy_paths`` maps each attribute holding a ComfyUI submodule to that submodule's path inside
    ``diffusion_model``; LoRA key mapping and the LoRA target predicate rely on it, so the saved file
    and the targets use ComfyUI's own names. ``swappable`` marks the repeated transformer blocks: block
    swap (training/offload) may keep their frozen weights off the GPU between uses. Embedders and final
    layers stay resident.
    """

    comfy_paths: dict[str, str]
    swappable: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.comfy_paths = {}
        self._adopted_tensors: dict[str, tuple[nn.Module, str]] = {}

    def adopt(self, attr: str, module: nn.Module, comfy_path: str) -> None:
        """Hold ``module`` as ``self.<attr>`` and remember where it lives in the ComfyUI model."""
        setattr(self, attr, module)
        self.comfy_paths[attr] = comfy_path

    def adopt_same(self, dm: nn.Module, *names: str) -> None:
        """Adopt each ``dm.<name>`` under the same attribute name and module path."""
        for name in names:
            self.adopt(name, getattr(dm, name), name)

    def adopt_tensor(self, attr: str, owner: nn.Module, name: str) -> None:
        """Hold the parameter or buffer ``owner.<name>`` itself as ``self.<attr>``.

        For a tensor the ComfyUI model holds outside the modules a layer adopts (SD3's ``pos_embed``, a
        buffer of the model itself). Loading fills ``owner``'s tensor, so the layer must hold that very
        tensor, never a copy. A move of the layer (``to``, ``cuda``: torch replaces buffers, and on some
        devices parameters, by new tensors) points ``owner`` at the moved tensor too (:meth:`_apply`),
        so the two never part: a later load fills the moved tensor, and no stale host copy stays behind.
        """
        if name in owner._parameters:
            self.register_parameter(attr, owner._parameters[name])
        elif name in owner._buffers:
            self.register_buffer(attr, owner._buffers[name], persistent=False)
        else:
            raise AttributeError(f"{type(owner).__name__} has no parameter or buffer {name!r}")
        self._adopted_tensors[attr] = (owner, name)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        for attr, (owner, name) in self._adopted_tensors.items():
            slots = owner._parameters if name in owner._parameters else owner._buffers
            slots[name] = self._parameters[attr] if attr in self._parameters else self._buffers[attr]
        return out

    def comfy_path(self, name: str) -> str | None:
        """The ComfyUI module path of the submodule ``name`` (as in ``named_modules``), or None for a
        module the layer does not adopt from the ComfyUI model (such modules never get LoRA)."""
        attr, _, inner = name.partition(".")
        base = self.comfy_paths.get(attr)
        if base is None:
            return None
        return ".".join(p for p in (base, inner) if p)


@dataclass(frozen=True)
class ExtraSpec:
    """A named per-example tensor a family needs besides latent, text cond and pooled vector.

    The cache writes it into the item's latent or text entry (``source``) under its name; the adapter
    declares it so preflight can check a cache against the model without loading tensors. ``shape``
    holds ints (fixed sizes) and letters bound to the example: ``C``/``F``/``H``/``W`` the latent's
    channels, frames, height and width, ``T`` the text tokens; ``*`` is any size. An extra that
    ``follows_text`` (a text attention mask) is brought to the micro-batch's text length with the cond.
    An extra that ``is_latent`` (a reference image's raw VAE latent, see :func:`reference_extra`) gets
    the model's ``process_latent_in`` like the training latent. An extra that ``joins_latent`` is a further
    stream of a model that takes several latents as one (LTX-2's audio latent beside the video latent):
    it is packed after the training latent in ComfyUI's layout (``comfy.utils.pack_latents``, what the
    sampler noises), so it gets the same sigma and its own noise, and the loss covers it
    (training/data/joint_latent.py); the first stage receives the packed latent and ``Batch.latent_shapes``.
    A float extra reaches the first stage in the compute dtype unless it ``keeps_float32``: one ComfyUI hands the
    model in float32 whatever its dtype (MiniMax-H3's condition latents ride in a payload ``_apply_model``
    leaves uncast).
    """

    shape: tuple[int | str, ...]
    source: str = "latent"  # "latent" or "text": the cache entry it is stored in
    required: bool = True
    follows_text: bool = False
    description: str = ""
    is_latent: bool = False
    joins_latent: bool = False
    keeps_float32: bool = False


REFERENCE_PREFIX = "reference_"


def reference_extra(index: int) -> str:
    """The extra name of an item's ``index``-th reference image (0-based, the Dataset node's order):
    the cache stores its raw VAE latent ``[C, h, w]`` under this name in the item's latent entry."""
    return f"{REFERENCE_PREFIX}{index}"


REFERENCE_AUDIO_PREFIX = "ref_audio_"
REFERENCE_MEDIA_PREFIXES = (REFERENCE_AUDIO_PREFIX, "ref_video_", "guide_")  # reference audio, videos, their
# tracks, and guides (MiniMax-H3's): extras only a family that takes them may find in a cache


def reference_audio_extra(index: int) -> str:
    """The extra name of an item's ``index``-th reference audio (0-based, the Dataset node's order): the cache stores
    the audio VAE's latent of the whole file under this name in the item's latent entry."""
    return f"{REFERENCE_AUDIO_PREFIX}{index}"


def reference_video_extra(index: int) -> str:
    """The extra name of an item's ``index``-th reference video (0-based): its video latent ``[C, T, h, w]``."""
    return f"ref_video_{index}"


def reference_video_audio_extra(index: int) -> str:
    """The extra name of the sound track of reference video ``index``: the audio VAE's latent of the whole track."""
    return f"ref_video_audio_{index}"


@dataclass(frozen=True)
class Geometry:
    """Spatial, temporal and frame-count rules of the model's latent input.

    ``patch`` is ``(frames, height, width)`` patch sizes (frames 1 for image models). ``video``: the
    model takes ``[B, C, F, H, W]`` latents, and an image latent ``[C, H, W]`` trains as a 1-frame
    video. ``frame_step``: clips have 1 or ``frame_step * k + 1`` pixel frames (the VAE's rule).
    ``min_patches``: latents smaller than this many patches per side leave next to nothing to learn.
    """

    patch: tuple[int, int, int] = (1, 2, 2)
    video: bool = False
    frame_step: int = 1
    min_patches: int = 4

    @property
    def temporal_patch(self) -> int:
        return self.patch[0]

    @property
    def spatial_patch(self) -> tuple[int, int]:
        return self.patch[1], self.patch[2]


@dataclass(frozen=True)
class Batch:
    """Everything a first stage may be built from, for one micro-batch (already on the CPU, compute dtype).

    ``noisy`` is the network input (``model_sampling.calculate_input`` of the noised latent), ``clean``
    the clean latent after ``process_latent_in`` (families that condition on clean frames read it),
    ``extras`` the stacked named extras of :class:`ExtraSpec`, ``options`` the family's typed options.
    ``latent_shapes``: when the family joins streams into one latent (``ExtraSpec.joins_latent``), the
    ``[B, ...]`` shape of each stream packed in ``noisy`` and ``clean`` (ComfyUI's ``latent_shapes``), else empty.
    ``text_lengths``: each cond's own token count before the micro-batch brought them to one length (empty: all
    ``cond.shape[1]``), for families whose model must see each caption at its own length.
    """

    noisy: torch.Tensor
    timestep: torch.Tensor
    cond: torch.Tensor | None
    pooled: torch.Tensor | None = None
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)
    options: Any = None
    clean: torch.Tensor | None = None
    latent_shapes: tuple[tuple[int, ...], ...] = ()
    text_lengths: tuple[int, ...] = ()


class FamilyAdapter(Protocol):
    """What the trainer needs to know about one model family."""

    name: str

    options_type: type
    """A frozen dataclass of the family's training options (training/pipelines/options.py)."""

    def support_problems(self, diffusion_model: nn.Module) -> list[str]:
        """Why this registered model class cannot be trained after all (a relative with another data
        flow), or nothing. Pure: preflight calls it in the ComfyUI process, ``stage_layers`` raises it."""
        ...

    def stage_layers(self, diffusion_model: nn.Module) -> list[StageLayer]:
        """The model as an ordered list of layers for a pipeline (flat tuples of tensors in and out)."""
        ...

    def layer_layout(self, diffusion_model: nn.Module) -> list[bool]:
        """``stage_layers``' ``swappable`` flags, without building the layers (preflight's block swap check)."""
        ...

    def lora_target_regex(self, preset: str) -> str:
        """A regex over ComfyUI module paths (``diffusion_model``-relative) selecting the Linears of
        ``preset``; :mod:`.targets` is the one place that applies it."""
        ...

    def geometry(self, diffusion_model: nn.Module) -> Geometry:
        """Patch sizes, video or image, frame rule of this model."""
        ...

    def conditioning_dims(self, diffusion_model: nn.Module) -> tuple[int, int]:
        """``(context width, pooled width or 0)`` the model takes: preflight checks the cache against it."""
        ...

    def extras(self, diffusion_model: nn.Module) -> Mapping[str, ExtraSpec]:
        """The named extras this model needs from the cache (empty for text-only conditioning)."""
        ...

    def image_tokens(self, diffusion_model: nn.Module, latent_shape: tuple[int, ...]) -> int:
        """Image tokens the model makes of one latent of ``latent_shape`` (resolution-dependent shift)."""
        ...

    def first_stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """The tuple the first stage layer receives."""
        ...

    def loss_mask(self, latent_shape: tuple[int, ...], options: object) -> torch.Tensor | None:
        """Weights broadcastable to one example's prediction (``latent_shape``), or None to weigh every
        element alike. 0 leaves an element out of the loss (e.g. a clean conditioning frame)."""
        ...

    def text_length(self, lengths: Sequence[int]) -> int:
        """Tokens every text cond of a micro-batch is brought to, given the cached lengths of its conds.

        Micro-batches group by latent shape only, so captions of different token counts meet in one
        batch; shorter conds get zero tokens appended, longer ones are cut. A family whose model takes
        a text attention mask also masks the added tokens (in ``first_stage_inputs``)."""
        ...


def refuse_unsupported(adapter: FamilyAdapter, diffusion_model: nn.Module) -> None:
    """Raise the adapter's :meth:`~FamilyAdapter.support_problems` (``stage_layers`` calls this first)."""
    problems = adapter.support_problems(diffusion_model)
    if problems:
        raise NotImplementedError(" ".join(problems))


_ADAPTERS: dict[str, FamilyAdapter] = {}  # family name -> adapter
_MODEL_CLASSES: dict[str, str] = {}  # ComfyUI model class name (comfy.model_base.<name>) -> family name
_EXACT_CLASSES: set[str] = set()  # those of _MODEL_CLASSES that are their family only as the model's own class
_UNTRAINABLE: dict[str, str] = {}  # ComfyUI model class name -> why PipeTrainer cannot train it
_discovered = False


class UnknownFamilyError(ValueError):
    pass


def register(adapter: FamilyAdapter, model_classes: Sequence[str], exact_classes: Sequence[str] = ()) -> FamilyAdapter:
    """Make ``adapter`` the family of the ComfyUI model classes named (and of their subclasses, unless
    a subclass is registered itself) and of the ``exact_classes`` (never of their subclasses); returns the
    adapter, so a module can write ``ADAPTER = register(...)``."""
    for cls in (*model_classes, *exact_classes):
        owner = _MODEL_CLASSES.get(cls)
        if owner is not None and owner != adapter.name:
            raise ValueError(f"ComfyUI model class {cls} is registered by both {owner} and {adapter.name}.")
        _MODEL_CLASSES[cls] = adapter.name
    _EXACT_CLASSES.update(exact_classes)
    _ADAPTERS[adapter.name] = adapter
    return adapter


def _discover() -> None:
    """Import every module of this package once, so each family module registers itself."""
    global _discovered
    if _discovered:
        return
    package = importlib.import_module(__package__)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if not info.ispkg:
            importlib.import_module(f"{__package__}.{info.name}")
    _discovered = True


def known_families() -> list[str]:
    _discover()
    return sorted(_ADAPTERS)


def model_classes_of(family: str) -> list[str]:
    """The ComfyUI model class names registered for ``family``."""
    _discover()
    return sorted(cls for cls, name in _MODEL_CLASSES.items() if name == family)


def refuse_model_class(name: str, reason: str) -> None:
    """Say why ComfyUI's model class ``name`` (exactly that class) cannot be trained, where a family module
    knows it (a relative its family does not claim): the refusal then names the class and gives ``reason``."""
    _UNTRAINABLE[name] = reason


def family_name_for(model_base: object) -> str:
    """The registered family of a ComfyUI ``BaseModel`` instance, walking its class hierarchy (a class
    registered exactly counts only as the model's own class)."""
    _discover()
    own = type(model_base)
    for cls in own.__mro__:
        if cls.__name__ in _MODEL_CLASSES and (cls is own or cls.__name__ not in _EXACT_CLASSES):
            return _MODEL_CLASSES[cls.__name__]
    if own.__name__ in _UNTRAINABLE:
        raise UnknownFamilyError(f"PipeTrainer cannot train {own.__name__} models: {_UNTRAINABLE[own.__name__]}")
    raise UnknownFamilyError(
        f"PipeTrainer cannot train {type(model_base).__name__} models yet. "
        f"Supported model families: {', '.join(known_families())}. "
        "Load one of those with 'Load Diffusion Model (PipeTrainer)'."
    )


def adapter_for(family: str) -> FamilyAdapter:
    """The adapter of a registered family name (see :func:`family_name_for`)."""
    _discover()
    if family not in _ADAPTERS:
        raise UnknownFamilyError(f"Unknown family {family!r}. Supported: {', '.join(known_families())}.")
    return _ADAPTERS[family]

"""Family-dependent preflight checks: a cache and a LoRA preset against a ComfyUI model, as pure functions.

The node layer (nodes/checks/preflight.py) reads the facts (cached tensor shapes from the cache index, the
ComfyUI MODEL) and calls these; every rule they apply comes from the family adapter (patch sizes,
video or image, text widths, named extras, LoRA targets), so a new family brings its own checks
with its module. Nothing here builds stage layers, imports the trainer libraries (DeepSpeed, PEFT)
or loads a tensor: it runs in the ComfyUI process.

Timestep settings are checked against the model's prediction kind (:func:`timestep_problems`: the
flow-only ones are refused for eps/v models), and a family's own rules over its options, the
timesteps and the cached latents run through the adapter's optional ``preflight_problems``
(:func:`family_rule_problems`; e.g. Wan's expert range and ``first_frame_clean``, Qwen-Image's frames).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..cache.start_image import CLIP_FEA, START_IMAGE_EXTRAS
from ..objective.loss import prediction_type
from ..spec.options import TimestepSpec
from .base import (
    REFERENCE_MEDIA_PREFIXES,
    REFERENCE_PREFIX,
    ExtraSpec,
    Geometry,
    UnknownFamilyError,
    adapter_for,
    family_name_for,
)
from .options import parse_family_options
from .targets import model_targets

MAX_NAMED = 20  # items named per problem; the rest are counted


def _named(names: Sequence[str]) -> str:
    shown = ", ".join(names[:MAX_NAMED])
    return shown + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")


@dataclass(frozen=True)
class CachedShapes:
    """Tensor shapes of the cached items, read from the cache index or file headers (no tensor is loaded).

    Entries are keyed by an entry id (container file + key); ``items`` pairs each dataset item's
    source name with its latent and text entry ids, so extras can be checked against their item.
    """

    latents: dict[str, tuple[int, ...]]  # entry -> [C, H, W] or [C, F, H, W]
    conds: dict[str, tuple[int, ...]]  # entry -> [T, D]
    pooled: dict[str, int]  # entry -> D (0: no pooled vector)
    unreadable: tuple[str, ...]
    extras: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)  # entry -> name -> shape
    items: tuple[tuple[str, str, str], ...] = ()  # (source name, latent entry, text entry)


@dataclass(frozen=True)
class ModelInputs:
    """What a ComfyUI model takes, as its family adapter describes it."""

    family: str
    latent_channels: int
    geometry: Geometry
    context_dim: int
    pooled_dim: int
    extras: Mapping[str, ExtraSpec] = field(default_factory=dict)

    @property
    def patch_size(self) -> int:
        """The spatial patch size (height; every family so far patches square)."""
        return self.geometry.spatial_patch[0]


def model_inputs(model_base: object) -> ModelInputs | None:
    """What the ComfyUI ``BaseModel`` takes, or None when its family is not trainable (reported elsewhere)."""
    try:
        family = family_name_for(model_base)
        adapter = adapter_for(family)
    except (UnknownFamilyError, ImportError):
        return None
    dm = model_base.diffusion_model
    context, pooled = adapter.conditioning_dims(dm)
    channels = int(getattr(model_base.latent_format, "latent_channels", 0) or getattr(dm, "in_channels", 0))
    return ModelInputs(family, channels, adapter.geometry(dm), int(context), int(pooled), dict(adapter.extras(dm)))


def model_support_problems(model_base: object) -> list[str]:
    """A known family's adapter may still refuse this model (Flux.2, Fill, Ovis-Image are
    loaded as Flux): its reason, before launching, instead of in the training process."""
    inputs = model_inputs(model_base)
    if inputs is None:
        return []
    problems = list(adapter_for(inputs.family).support_problems(model_base.diffusion_model))
    try:  # a relative with its own prediction formula (e.g. WAN21_FlowRVS) is not trained as the family's
        prediction_type(model_base.model_sampling)
    except NotImplementedError as exc:
        problems.append(f"PipeTrainer cannot train this {type(model_base).__name__} model: {exc}")
    return problems


def block_layout(model_base: object) -> list[bool]:
    """The engine's layer list as swappable-or-not: the input preparation, then the family's stage layers."""
    inputs = model_inputs(model_base)
    if inputs is None:
        return []
    return [False, *adapter_for(inputs.family).layer_layout(model_base.diffusion_model)]


def lora_parameter_count(model_base: object, rank: int, preset: str) -> int:
    """LoRA parameters a run trains: ``rank * (in + out)`` for every target (the trainer's own rule)."""
    inputs = model_inputs(model_base)
    if inputs is None:
        return 0
    regex = adapter_for(inputs.family).lora_target_regex(preset)
    return sum(rank * (m.in_features + m.out_features) for m in model_targets(model_base.diffusion_model, regex).values())


# ---- the cache against the model --------------------------------------------------------------
def latent_channel_problems(channels: Mapping[str, int], model_channels: int, family: str) -> list[str]:
    wrong = sorted({c for c in channels.values() if c != model_channels})
    if not wrong:
        return []
    return [f"The cached latents have {'/'.join(map(str, wrong))} channels but the {family} model takes "
            f"{model_channels}: the VAE given to 'Cache Latents & Text' belongs to another model family. "
            "Use this model's VAE and cache again."]


def latent_size_problems(sizes: Mapping[str, tuple[int, int]], patch_size: int, family: str,
                         min_patches: int = 4) -> list[str]:
    """Latent sides must be whole multiples of the patch size and at least ``min_patches`` patches."""
    odd = sorted({hw for hw in sizes.values() if hw[0] % patch_size or hw[1] % patch_size})
    small = sorted({hw for hw in sizes.values() if min(hw) < min_patches * patch_size})
    out = []
    if odd:
        out.append(f"The cached latents of {', '.join(f'{h}x{w}' for h, w in odd)} are not multiples of the {family} "
                   f"model's patch size {patch_size}, so the model would pad them: choose a resolution (and bucket "
                   f"multiple) divisible by {patch_size} x the VAE's downscale (e.g. {patch_size * 8} px for an 8x VAE).")
    if small:
        out.append(f"The cached latents of {', '.join(f'{h}x{w}' for h, w in small)} are too small: the {family} model "
                   f"needs at least {min_patches * patch_size} latent pixels per side "
                   f"(e.g. {min_patches * patch_size * 8} px for an 8x VAE). Raise the resolution.")
    return out


def latent_frame_problems(latents: Mapping[str, tuple[int, ...]], geometry: Geometry, family: str) -> list[str]:
    """Video latents ``[C, F, H, W]`` need a video model, and ``F`` a multiple of its temporal patch."""
    frames = sorted({s[1] for s in latents.values() if len(s) == 4})
    if not frames:
        return []
    if not geometry.video:
        return [f"The cache holds video latents ({'/'.join(map(str, frames))} latent frames) but the {family} model "
                "is an image model: train it on images, or load a video model."]
    t = geometry.temporal_patch
    odd = [f for f in frames if f % t]
    if odd:
        return [f"The cached videos have {'/'.join(map(str, odd))} latent frames, not multiples of the {family} "
                f"model's temporal patch {t}: choose frame counts that give multiples of {t} latent frames."]
    return []


def text_dim_problems(cond_dims: Mapping[str, int], pooled_dims: Mapping[str, int], context_dim: int,
                      pooled_dim: int, family: str) -> list[str]:
    """Text embeddings must have the width of the model's context input (and pooled vector, if it takes one)."""
    out = []
    wrong = sorted({d for d in cond_dims.values() if d != context_dim})
    if wrong:
        out.append(f"The cached text embeddings are {'/'.join(map(str, wrong))} wide but the {family} model's context "
                   f"input takes {context_dim}: the CLIP / text encoder given to 'Cache Latents & Text' belongs to "
                   "another model family. Load this model's text encoder(s) and cache again.")
    wrong_pooled = sorted({d for d in pooled_dims.values() if d != pooled_dim})
    if pooled_dim and wrong_pooled:
        got = "/".join("none" if d == 0 else str(d) for d in wrong_pooled)
        out.append(f"The cached pooled text vectors are {got} wide but the {family} model takes {pooled_dim}: "
                   "use the text encoder(s) of this model family (e.g. CLIP-L/G for SD3) and cache again.")
    return out


def expected_extra_shape(spec: ExtraSpec, latent: tuple[int, ...], cond: tuple[int, ...] | None) -> tuple | None:
    """The shape ``spec`` asks for with this item's sizes bound (``*`` stays), or None if a size is unknown."""
    c, f, h, w = (latent[0], 1, *latent[-2:]) if len(latent) == 3 else latent
    sizes = {"C": c, "F": f, "H": h, "W": w}
    if cond is not None:
        sizes["T"] = cond[0]
    out = []
    for dim in spec.shape:
        if isinstance(dim, int) or dim == "*":
            out.append(dim)
        elif dim in sizes:
            out.append(sizes[dim])
        else:
            return None
    return tuple(out)


def extra_problems(shapes: CachedShapes, specs: Mapping[str, ExtraSpec], family: str) -> list[str]:
    """Every required extra is in the cache, and every cached one has the shape the model declares.

    Reference images (``reference_<i>``, the Dataset node's control folder) get their own wording, and
    cached references the model takes no extra for are problems too: they would be dropped silently. So is
    start-image conditioning (the Cache node's ``start_image``) for a model that takes none, e.g. a
    text-to-video model: it is an error, not a warning, because the user asked for image-to-video
    training and would get a LoRA that never saw the start image. A spec's ``fix`` (if it has one) says
    which Cache node option makes a missing extra."""
    missing: dict[str, list[str]] = {}
    wrong: dict[str, list[str]] = {}
    unused: dict[str, list[str]] = {}
    unused_start: dict[str, list[str]] = {}
    unheard: dict[str, list[str]] = {}
    for source, latent_entry, text_entry in shapes.items:
        latent = shapes.latents.get(latent_entry)
        if latent is None:
            continue  # unreadable: reported on its own
        cond = shapes.conds.get(text_entry)
        for name in shapes.extras.get(latent_entry, {}):
            if name.startswith(REFERENCE_PREFIX) and name not in specs:
                unused.setdefault(name, []).append(source)
            elif name.startswith(REFERENCE_MEDIA_PREFIXES) and name not in specs:
                unheard.setdefault(name, []).append(source)
            elif name in START_IMAGE_EXTRAS and name not in specs:
                unused_start.setdefault(name, []).append(source)
        for name, spec in specs.items():
            entry = latent_entry if spec.source == "latent" else text_entry
            got = shapes.extras.get(entry, {}).get(name)
            if got is None:
                if spec.required:
                    missing.setdefault(name, []).append(source)
                continue
            expected = expected_extra_shape(spec, latent, cond)
            if expected is not None and (len(got) != len(expected) or any(
                    e != "*" and e != g for e, g in zip(expected, got, strict=True))):
                wrong.setdefault(name, []).append(f"{source} {list(got)} (expected {list(expected)})")
    out = []
    for name, sources in missing.items():
        what = specs[name].description or name
        if name.startswith(REFERENCE_PREFIX):
            out.append(f"The {family} model needs {what} ('{name}') for every item, and the cache has none for "
                       f"{_named(sources)}: give the Dataset node a control folder with reference images named "
                       f"like the training images ({_reference_file(name)} for this one) and cache again.")
            continue
        fix = getattr(specs[name], "fix", "") or "cache the dataset again with the inputs this model needs"
        out.append(f"The {family} model needs {what} ('{name}') for every item, and the cache has none for "
                   f"{_named(sources)}: {fix}.")
    if unused:
        takes = sorted(n for n in specs if n.startswith(REFERENCE_PREFIX))
        what = f"takes only {', '.join(takes)}" if takes else "takes no reference images"
        held = "; ".join(f"'{name}' ({_reference_file(name)}) for {_named(sources)}"
                         for name, sources in sorted(unused.items()))
        out.append(f"The cache holds reference images the {family} model would ignore ({held}): the model {what}. "
                   "Remove those references from the control folder (or clear control_folder), or load an edit "
                   "model, and cache again.")
    if unheard:
        held = "; ".join(f"'{name}' for {_named(sources)}" for name, sources in sorted(unheard.items()))
        out.append(f"The cache holds reference or guide media the {family} model would ignore ({held}): remove the "
                   "audio files and videos from the control folder, set audio_guide to none (or load the model they "
                   "are for) and cache again.")
    if unused_start:
        held = "; ".join(f"'{name}' for {_named(sources)}" for name, sources in sorted(unused_start.items()))
        takes = sorted(n for n in specs if n in START_IMAGE_EXTRAS)
        if takes and set(unused_start) <= {CLIP_FEA}:  # an image-to-video model without a CLIP-vision input (Wan 2.2 I2V)
            fix = (f"the model takes only {', '.join(takes)}: disconnect clip_vision from 'Cache Latents & Text' "
                   "and cache again")
        elif takes:  # another family's start-image mode (HunyuanVideo 1.5's first_frame_alone for Wan)
            fix = (f"it was made by another start_image mode than this model's (it takes {', '.join(takes)}): set "
                   "start_image on 'Cache Latents & Text' to the mode this model needs and cache again")
        else:
            fix = ("the model is not an image-to-video model: load the image-to-video model you meant to train, or "
                   "set start_image to none (and disconnect clip_vision) on 'Cache Latents & Text' and cache again")
        own = _family_start_image_problem(family)
        if own:  # a family whose image-to-video conditioning the cache cannot make yet says why
            out.append(f"The cache holds start-image conditioning ({held}): {own}.")
        else:
            out.append(f"The cache holds start-image conditioning the {family} model would ignore ({held}): {fix}.")
    for name, found in wrong.items():
        out.append(f"The cached '{name}' of {_named(found)} does not fit the {family} model: cache again with "
                   "this model's encoders.")
    return out


def _family_start_image_problem(family: str) -> str | None:
    """The adapter's own reason to refuse start-image conditioning (optional ``start_image_problem()``), if any."""
    try:
        adapter = adapter_for(family)
    except UnknownFamilyError:
        return None
    check = getattr(adapter, "start_image_problem", None)
    return check() if check is not None else None


def _reference_file(name: str) -> str:
    """The control-folder file of reference extra ``name``: ``name.png`` for 0, ``name_<i>.png`` after."""
    index = name[len(REFERENCE_PREFIX):]
    return "name.png" if index == "0" else f"name_{index}.png"


def cache_vs_model_problems(shapes: CachedShapes, inputs: ModelInputs) -> list[str]:
    g = inputs.geometry
    spatial = {p: (s[-2], s[-1]) for p, s in shapes.latents.items() if len(s) >= 3}
    out = latent_channel_problems({p: s[0] for p, s in shapes.latents.items()}, inputs.latent_channels, inputs.family)
    out += latent_size_problems(spatial, g.spatial_patch[0], inputs.family, g.min_patches)
    out += latent_frame_problems(shapes.latents, g, inputs.family)
    if inputs.context_dim:
        out += text_dim_problems({p: s[-1] for p, s in shapes.conds.items()}, shapes.pooled, inputs.context_dim,
                                 inputs.pooled_dim, inputs.family)
    out += extra_problems(shapes, inputs.extras, inputs.family)
    return out


# ---- timestep settings and family options against the model ----------------------------------------
_PREDICTION_NAMES = {"eps": "eps-prediction", "v": "v-prediction", "rflow": "rectified-flow"}


def timestep_problems(timesteps: TimestepSpec, prediction: str, family: str,
                      sigma_range: tuple[float, float]) -> list[str]:
    """Settings of 'Timestep Sampling (PipeTrainer)' that only mean something for flow-matching models.

    ``shift`` none / fixed / resolution map a draw in [0, 1] straight to a flow-matching sigma (noise
    share 0 to 1), and ``sigma_min`` / ``sigma_max`` are such noise shares; an eps- or v-prediction
    model (SDXL, CosXL) has its own sigma schedule (``sigma_range``, e.g. 0.03 to 14.6), so those
    settings would train noise levels its sampler never visits. ``prediction``: training/objective/loss.py's kind.
    """
    if prediction == "flow":
        return []
    kind = _PREDICTION_NAMES.get(prediction, prediction)
    low, high = sigma_range
    schedule = f"its own sigma schedule ({low:.3g} to {high:.3g})"
    out = []
    if timesteps.shift != "model":
        out.append(f"Timestep Sampling: shift '{timesteps.shift}' maps draws to flow-matching noise levels (0 to 1), "
                   f"but this {family} model is {kind} with {schedule}: set shift to 'model' on the Timestep "
                   "Sampling node (or disconnect it; distribution and logit_mean/logit_std still apply).")
    if timesteps.sigma_min > 0.0 or timesteps.sigma_max < 1.0:
        out.append(f"Timestep Sampling: sigma_min {timesteps.sigma_min} / sigma_max {timesteps.sigma_max} are "
                   f"flow-matching noise levels (0 to 1), but this {family} model is {kind} with {schedule}: set "
                   "sigma_min to 0 and sigma_max to 1 on the Timestep Sampling node (or disconnect it).")
    if timesteps.loss_weighting != "none":  # SD3's weights are functions of the flow noise share
        out.append(f"Timestep Sampling: loss_weighting '{timesteps.loss_weighting}' weighs flow-matching noise "
                   f"levels (0 to 1), but this {family} model is {kind} with {schedule}: set loss_weighting to "
                   "'none' on the Timestep Sampling node.")
    return out


def model_timestep_problems(model_base: object, timesteps: TimestepSpec) -> list[str]:
    """:func:`timestep_problems` for a ComfyUI ``BaseModel`` (its ``model_sampling`` says the kind)."""
    inputs = model_inputs(model_base)
    if inputs is None:
        return []
    ms = model_base.model_sampling
    try:
        prediction = prediction_type(ms)
    except NotImplementedError:
        return []  # refused by model_support_problems
    return timestep_problems(timesteps, prediction, inputs.family, (float(ms.sigma_min), float(ms.sigma_max)))


@dataclass(frozen=True)
class FamilyFacts:
    """What a family's own preflight rules may look at (an adapter's optional ``preflight_problems``).

    ``options``: the family's typed options (``options_type``); ``timesteps``: the run's timestep
    settings; ``latents``: source name -> cached latent shape (``[C, H, W]`` or ``[C, F, H, W]``).
    """

    options: object
    timesteps: TimestepSpec
    latents: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


def family_rule_problems(model_base: object, family_options: Mapping[str, object], timesteps: TimestepSpec,
                         shapes: CachedShapes | None = None) -> list[str]:
    """The family adapter's own rules for this model, its options and the cache, when it has any.

    An adapter may define ``preflight_problems(diffusion_model, facts: FamilyFacts) -> list[str]``
    (pure; e.g. Wan: an expert whose sigma range is empty, ``first_frame_clean`` on a model that is
    not TI2V). Options that do not parse are reported by the Train node and skipped here."""
    inputs = model_inputs(model_base)
    if inputs is None:
        return []
    adapter = adapter_for(inputs.family)
    check = getattr(adapter, "preflight_problems", None)
    if check is None:
        return []
    options, problems = parse_family_options(inputs.family, adapter.options_type, dict(family_options))
    if problems:
        return []
    latents = {}
    if shapes is not None:
        latents = {source: shapes.latents[entry] for source, entry, _ in shapes.items if entry in shapes.latents}
    return list(check(model_base.diffusion_model, FamilyFacts(options, timesteps, latents)))

"""The adapter types a run can train (LoRA, LoKr, LoHa): one small entry per type, one registry.

Every place that used to know "lora_A / lora_B" asks the entry of the run's type instead:
injection (its PEFT config), initialisation (which factors start at zero so the first update is
zero), freezing and gathering (which parameters are the adapter's), the LoRA file (ComfyUI's key
names for each factor, and how PEFT's scale becomes ComfyUI's), LoRA+ (which factor is the "up"
one) and the zero-update check. Adding a type is one :class:`AdapterKind` and one ``register``.

The file formats follow ComfyUI's loaders (``comfy/weight_adapter/{lora,lokr,loha}.py``, the same
arithmetic on 0.3.75 and current ComfyUI):

- LoRA: ``lora_A.weight`` / ``lora_B.weight`` / ``alpha``; ComfyUI scales ``B @ A`` by alpha / rank.
- LoKr: ``lokr_w1`` and ``lokr_w2`` (or ``lokr_w2_a`` / ``lokr_w2_b``) and ``alpha``; ComfyUI applies
  ``kron(w1, w2)`` scaled by alpha / rank only when a factor is decomposed, and unscaled otherwise,
  while PEFT always scales by alpha / rank: with both factors whole the scale is folded into ``w1``.
- LoHa: ``hada_w1_a`` / ``hada_w1_b`` / ``hada_w2_a`` / ``hada_w2_b`` / ``alpha``; ComfyUI scales
  ``(w1a @ w1b) * (w2a @ w2b)`` by alpha / rank, as PEFT does.

DoRA is not offered: ComfyUI's ``weight_decompose`` (both hosts) divides the magnitude by the row
norm of the *base* weight, where PEFT divides by the row norm of the base weight *plus* the update,
so a PEFT-trained DoRA would not apply in ComfyUI as it was trained.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..spec.choices import ADAPTER_TYPES
from ..spec.options import LoraSpec

ADAPTER_NAME = "default"  # PEFT's adapter name; the project trains one adapter per layer


@dataclass(frozen=True)
class AdapterKind:
    """What the trainer needs to know about one adapter type.

    ``factors``: PEFT's attribute of each trainable factor -> its ComfyUI key suffix, in the order the
    initial values are drawn. ``zero_init``: the factors that start at zero (all others are drawn
    Kaiming-uniform), so a fresh adapter changes nothing. ``up``: the factors LoRA+ speeds up (none:
    LoRA+ does not apply). ``quant_layers``: whether :class:`~.quant.layers.QuantLinearLora` implements
    it on ComfyUI's per-layer-quantized Linears. ``to_file`` turns one module's ``{factor: fp32 tensor}``
    into its ``{ComfyUI suffix: tensor}`` (scale conventions included); ``from_file`` is its inverse
    (continuing from a file, training/adapters/init_lora.py), and ``file_rank`` reads the rank off one module's
    ``{ComfyUI suffix: shape}`` (None where the layout does not show it)."""

    name: str
    factors: Mapping[str, str]
    zero_init: tuple[str, ...]
    peft_config: Callable[[LoraSpec, str], object]
    peft_layer: Callable[[], type]
    to_file: Callable[[Mapping[str, torch.Tensor], LoraSpec], dict[str, torch.Tensor]]
    from_file: Callable[[Mapping[str, torch.Tensor], LoraSpec], dict[str, torch.Tensor]]
    file_rank: Callable[[Mapping[str, tuple[int, ...]]], int | None]
    up: tuple[str, ...] = ()
    quant_layers: bool = False
    file_format: str = ""
    extra: Mapping[str, object] = field(default_factory=dict)

    @property
    def zero_init_suffixes(self) -> tuple[str, ...]:
        """File key endings of the zero-initialised factors: all still 0 means the file changes nothing."""
        return tuple("." + self.factors[f] for f in self.zero_init)

    def up_markers(self) -> tuple[str, ...]:
        """Substrings of PEFT parameter names of the ``up`` factors (LoRA+)."""
        return tuple(f".{f}." for f in self.up)


REGISTRY: dict[str, AdapterKind] = {}


def register(kind: AdapterKind) -> AdapterKind:
    REGISTRY[kind.name] = kind
    return kind


def adapter_kind(name: str) -> AdapterKind:
    """The registered kind called ``name``; an unknown name is an error listing the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"Unknown adapter type {name!r}: choose one of {', '.join(REGISTRY)}.") from None


# ---- LoRA ---------------------------------------------------------------------------------------


def _lora_config(spec: LoraSpec, target_regex: str) -> object:
    from peft import LoraConfig

    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=target_regex,
                      bias="none", init_lora_weights=False)


def _lora_layer() -> type:
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def _with_alpha(factors: Mapping[str, str]) -> Callable[[Mapping[str, torch.Tensor], LoraSpec], dict[str, torch.Tensor]]:
    """Each factor under its ComfyUI name plus ``alpha``: for the types whose ComfyUI scale is PEFT's."""
    def to_file(tensors: Mapping[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
        out = {factors[name]: t for name, t in tensors.items()}
        out["alpha"] = torch.tensor(float(spec.alpha), dtype=torch.float32)
        return out
    return to_file


def _factors_of(factors: Mapping[str, str]) -> Callable[[Mapping[str, torch.Tensor], LoraSpec], dict[str, torch.Tensor]]:
    """The inverse of :func:`_with_alpha`: each file tensor under its PEFT factor (``alpha`` is checked
    against the spec by training/adapters/init_lora.py, not loaded)."""
    by_suffix = {suffix: name for name, suffix in factors.items()}

    def from_file(tensors: Mapping[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
        return {by_suffix[suffix]: t for suffix, t in tensors.items() if suffix != "alpha"}
    return from_file


def _rank_from(suffix: str, dim: int) -> Callable[[Mapping[str, tuple[int, ...]]], int | None]:
    def file_rank(shapes: Mapping[str, tuple[int, ...]]) -> int | None:
        shape = shapes.get(suffix)
        return int(shape[dim]) if shape is not None and len(shape) == 2 else None
    return file_rank


_LORA_FACTORS = {"lora_A": "lora_A.weight", "lora_B": "lora_B.weight"}
register(AdapterKind(
    name="lora", factors=_LORA_FACTORS, zero_init=("lora_B",), peft_config=_lora_config, peft_layer=_lora_layer,
    to_file=_with_alpha(_LORA_FACTORS), from_file=_factors_of(_LORA_FACTORS), file_rank=_rank_from("lora_A.weight", 0),
    up=("lora_B",), quant_layers=True,
    file_format="diffusion_model.<ComfyUI module>.lora_A/lora_B/alpha",
))


# ---- LoKr ---------------------------------------------------------------------------------------


def _lokr_config(spec: LoraSpec, target_regex: str) -> object:
    from peft import LoKrConfig

    return LoKrConfig(r=spec.rank, alpha=spec.alpha, target_modules=target_regex, decompose_factor=spec.factor,
                      rank_dropout=0.0, module_dropout=0.0, init_weights=False)


def _lokr_layer() -> type:
    from peft.tuners.lokr import LoKrLayer

    return LoKrLayer


_LOKR_FACTORS = {"lokr_w1": "lokr_w1", "lokr_w1_a": "lokr_w1_a", "lokr_w1_b": "lokr_w1_b",
                 "lokr_w2": "lokr_w2", "lokr_w2_a": "lokr_w2_a", "lokr_w2_b": "lokr_w2_b"}


def _lokr_to_file(tensors: Mapping[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """ComfyUI scales by alpha / rank only when a factor is decomposed (``*_a``/``*_b``); PEFT always does.
    With both factors whole the scale goes into ``lokr_w1`` and no alpha is written (ComfyUI ignores it)."""
    out = {_LOKR_FACTORS[name]: t for name, t in tensors.items()}
    if any(name.endswith(("_a", "_b")) for name in tensors):
        out["alpha"] = torch.tensor(spec.alpha, dtype=torch.float32)
    else:
        out["lokr_w1"] = out["lokr_w1"] * (spec.alpha / spec.rank)
    return out


def _lokr_from_file(tensors: Mapping[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """The inverse of :func:`_lokr_to_file`: with both factors whole, ``lokr_w1`` carries PEFT's alpha / rank,
    which PEFT applies again, so it is divided out (fp32; a re-save multiplies it back to within an ulp)."""
    out = {name: tensors[suffix] for name, suffix in _LOKR_FACTORS.items() if suffix in tensors}
    if not any(name.endswith(("_a", "_b")) for name in out) and "lokr_w1" in out:
        out["lokr_w1"] = out["lokr_w1"] / (spec.alpha / spec.rank)
    return out


def _lokr_file_rank(shapes: Mapping[str, tuple[int, ...]]) -> int | None:
    """The rank of a decomposed factor (``w?_a`` is [dim, rank]); whole factors carry none."""
    for suffix in ("lokr_w2_a", "lokr_w1_a"):
        if suffix in shapes and len(shapes[suffix]) == 2:
            return int(shapes[suffix][1])
    return None


register(AdapterKind(
    name="lokr", factors=_LOKR_FACTORS, zero_init=("lokr_w1", "lokr_w1_a"), peft_config=_lokr_config,
    peft_layer=_lokr_layer, to_file=_lokr_to_file, from_file=_lokr_from_file, file_rank=_lokr_file_rank,
    file_format="diffusion_model.<ComfyUI module>.lokr_w1/lokr_w2 (or lokr_w2_a/lokr_w2_b + alpha)",
))


# ---- LoHa ---------------------------------------------------------------------------------------


def _loha_config(spec: LoraSpec, target_regex: str) -> object:
    from peft import LoHaConfig

    return LoHaConfig(r=spec.rank, alpha=spec.alpha, target_modules=target_regex, rank_dropout=0.0,
                      module_dropout=0.0, init_weights=False)


def _loha_layer() -> type:
    from peft.tuners.loha import LoHaLayer

    return LoHaLayer


_LOHA_FACTORS = {"hada_w1_a": "hada_w1_a", "hada_w1_b": "hada_w1_b", "hada_w2_a": "hada_w2_a",
                 "hada_w2_b": "hada_w2_b"}
register(AdapterKind(
    name="loha", factors=_LOHA_FACTORS, zero_init=("hada_w2_b",), peft_config=_loha_config, peft_layer=_loha_layer,
    to_file=_with_alpha(_LOHA_FACTORS), from_file=_factors_of(_LOHA_FACTORS), file_rank=_rank_from("hada_w1_a", 1),
    file_format="diffusion_model.<ComfyUI module>.hada_w1_a/hada_w1_b/hada_w2_a/hada_w2_b/alpha",
))

assert tuple(REGISTRY) == ADAPTER_TYPES, "training/spec/run_spec.py's ADAPTER_TYPES must list the registry's kinds"


# ---- names of adapter parameters ------------------------------------------------------------------

_ALL_FACTORS = frozenset(f for kind in REGISTRY.values() for f in kind.factors)


def split_adapter_name(param_name: str) -> tuple[str, str] | None:
    """``(module path, factor)`` of a PEFT adapter parameter name, or None for any other parameter.

    PEFT names them ``<module>.<factor>.default`` (LoKr, LoHa: ParameterDicts) or
    ``<module>.<factor>.default.weight`` (LoRA: Linears in ModuleDicts)."""
    parts = param_name.split(".")
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in _ALL_FACTORS and parts[i + 1] == ADAPTER_NAME and parts[i + 2:] in ([], ["weight"]):
            return ".".join(parts[:i]), parts[i]
    return None


def is_adapter_parameter(param_name: str) -> bool:
    return split_adapter_name(param_name) is not None


def adapter_modules(layer: nn.Module, kind: AdapterKind) -> Iterator[nn.Module]:
    """The modules of ``layer`` that hold an adapter of ``kind``, in module-tree order."""
    from ..quant.layers import QuantLinearLora

    peft_layer = kind.peft_layer()
    for module in layer.modules():
        if isinstance(module, peft_layer) or (kind.quant_layers and isinstance(module, QuantLinearLora)):
            yield module


def factor_parameter(module: nn.Module, factor: str) -> nn.Parameter | None:
    """The ``default`` adapter's tensor of ``factor`` in one adapter module (None if it has no such factor)."""
    holder = getattr(module, factor, None)
    if holder is None or ADAPTER_NAME not in holder:
        return None
    item = holder[ADAPTER_NAME]
    return item.weight if isinstance(item, nn.Module) else item


def init_fp32(layer: nn.Module, kind: AdapterKind, generator: torch.Generator) -> None:
    """fp32 initial values for every adapter of ``layer``: zero for ``kind.zero_init``, else Kaiming-uniform
    (a=sqrt(5), like ``nn.Linear``) drawn on the CPU from ``generator`` in a fixed order (module tree,
    then ``kind.factors``), so equal seeds give equal adapters on every base dtype, device and split."""
    for module in adapter_modules(layer, kind):
        for factor in kind.factors:
            p = factor_parameter(module, factor)
            if p is None:
                continue
            if p.dtype != torch.float32:  # PEFT moved it to the base weight's dtype
                p.data = p.data.float()
            with torch.no_grad():
                if factor in kind.zero_init:
                    p.zero_()
                else:
                    init = torch.empty(p.shape, dtype=torch.float32)
                    nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)
                    p.copy_(init)


def quant_layer_problem(kind: AdapterKind, names: list[str]) -> str | None:
    """Why ``kind`` cannot go on ComfyUI's per-layer-quantized Linears ``names`` (None when it can)."""
    if not names or kind.quant_layers:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"Adapter type {kind.name!r} cannot train on ComfyUI's per-layer-quantized Linears ({shown}): only "
            f"{', '.join(k.name for k in REGISTRY.values() if k.quant_layers)} can. Choose adapter 'lora' on the "
            "LoRA Adapter node, or load the model unquantized (or with weight_dtype fp8_e4m3fn).")



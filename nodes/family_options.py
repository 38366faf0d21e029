"""``Family Options (PipeTrainer)``: the options one model family takes, apart from Train LoRA.

Most runs need none (an SDXL or Qwen-Image LoRA has no family option), so they live on an optional node.
Its ``family`` input lists the registered families that declare options (``options_type`` in
training/pipelines/); on a host with conditional inputs (ComfyUI's ``DynamicCombo``) choosing a family
shows only that family's options, with that family's defaults. Older hosts show every option, and the
chosen family's are taken. A new family option needs no edit here: its widget is built from the
dataclass field's type and default; :data:`OPTION_WIDGETS` only adds ranges and tooltips to known names.

Connected to Train LoRA's ``family_options``, the values are the run's. Train LoRA keeps its widgets of the
same names (under its advanced section) so that saved workflows load with their values; a value this
node overrides is named on the Train node before step 0, as the GPUs & Memory node does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from comfy_api.latest import io

from ..training.pipelines.base import adapter_for, known_families
from ..training.pipelines.options import option_names, options_from_inputs, parse_family_options
from .types import CATEGORY

FamilyOptionsConfig = io.Custom("PIPETRAINER_FAMILY_OPTIONS")
NODE_TITLE = "Family Options (PipeTrainer)"

# Ranges and tooltips of the option names families declare today (widget keyword arguments); the widget
# type and default come from the family's dataclass field.
OPTION_WIDGETS: dict[str, dict[str, Any]] = {
    "guidance": dict(min=0.0, max=100.0, step=0.1,
                     tooltip="Guidance-distilled models (FLUX.1 dev, HunyuanVideo): the guidance the model sees "
                             "while training. 1.0, as the other trainers use: samples well at the usual 3.5."),
    "first_frame_clean": dict(tooltip="Image-to-video as ComfyUI samples it: the first latent frame stays clean "
                                      "and out of the loss. Off: text-to-video."),
    "expert": dict(options=["none", "high_noise", "low_noise"],
                   tooltip="Wan 2.2 A14B: which expert this file is; training draws only its noise levels "
                           "(high_noise: sigma at or above the boundary)."),
    "expert_boundary": dict(min=0.0, max=0.999, step=0.005,
                            tooltip="Wan 2.2 A14B expert boundary sigma; 0 = the Wan 2.2 default (0.875 "
                                    "text-to-video, 0.9 image-to-video)."),
    "frame_rate": dict(min=0.01, max=1000.0, step=0.001,
                       tooltip="The clips' frames per second, the frame_rate LTXVConditioning gets at sampling "
                               "(it sets the model's time positions)."),
}


@dataclass(frozen=True)
class FamilyOptions:
    """What the node outputs: the family it was set for and that family's option values."""

    family: str
    values: Mapping[str, Any] = field(default_factory=dict)

    def merged(self, model_family: str, own: Mapping[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
        """``(options, problems, notes)`` for a model of ``model_family`` whose Train LoRA widgets give
        ``own``: this node's values win, and a differing Train LoRA value is named in a note."""
        if self.family != model_family:
            takes = option_names(adapter_for(model_family).options_type)
            fix = (f"the model is {model_family}: choose {model_family} in its family input, or disconnect it"
                   if takes else f"the model is {model_family}, which takes no family option: disconnect it")
            return dict(own), [f"{NODE_TITLE} is set for {self.family}, but {fix} from Train LoRA."], []
        out, notes = dict(own), []
        for name, value in self.values.items():
            if name in own and own[name] != value:
                notes.append(f"{name}: {NODE_TITLE}'s {value!r} is used (Train LoRA's {own[name]!r} is set aside).")
            out[name] = value
        return out, [], notes


@cache
def families_with_options() -> tuple[str, ...]:
    """The registered families that declare at least one option, in the registry's order."""
    return tuple(f for f in known_families() if option_names(adapter_for(f).options_type))


def _widget(option: dataclasses.Field, optional: bool = False) -> io.Input:
    """The widget of one option field: its type from the default, range and tooltip from OPTION_WIDGETS."""
    extra = dict(OPTION_WIDGETS.get(option.name, {"tooltip": f"The family's {option.name} option."}))
    default = option.default
    if isinstance(default, bool):
        return io.Boolean.Input(option.name, default=default, optional=optional, **extra)
    if isinstance(default, float):
        return io.Float.Input(option.name, default=default, optional=optional, **extra)
    if isinstance(default, int):
        return io.Int.Input(option.name, default=default, optional=optional, **extra)
    if "options" in extra:
        return io.Combo.Input(option.name, default=default, optional=optional, **extra)
    return io.String.Input(option.name, default=str(default), optional=optional, **extra)


def _fields(family: str) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(adapter_for(family).options_type)


def _host_has_conditional_inputs() -> bool:
    return hasattr(io, "DynamicCombo")


def _inputs() -> list[io.Input]:
    families = list(families_with_options())
    tooltip = "The model's family (Train LoRA names it if this does not match the model)."
    if _host_has_conditional_inputs():
        return [io.DynamicCombo.Input("family", tooltip=tooltip, options=[
            io.DynamicCombo.Option(family, [_widget(f) for f in _fields(family)]) for family in families])]
    seen: dict[str, dataclasses.Field] = {}  # older hosts: every option once, the chosen family's are taken
    for family in families:
        for option in _fields(family):
            seen.setdefault(option.name, option)
    return [io.Combo.Input("family", options=families, default=families[0], tooltip=tooltip),
            *(_widget(option, optional=True) for option in seen.values())]


def chosen_options(family: str | Mapping[str, Any], flat: Mapping[str, Any]) -> FamilyOptions:
    """The node's value from what ComfyUI passes: a DynamicCombo's dict (the family under ``family``, its
    options beside it) or, on older hosts, the family's name and every option as its own input."""
    if isinstance(family, Mapping):
        name, given = str(family["family"]), {k: v for k, v in family.items() if k != "family"}
    else:
        name, given = family, dict(flat)
    takes = option_names(adapter_for(name).options_type)
    return FamilyOptions(name, {k: given[k] for k in takes if given.get(k) is not None})


class PipeTrainerFamilyOptions(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PipeTrainerFamilyOptions",
            display_name=NODE_TITLE,
            category=CATEGORY,
            description="Optional: the options of one model family (guidance, image-to-video, Wan 2.2 expert, "
                        "frame rate) for Train LoRA.",
            inputs=_inputs(),
            outputs=[FamilyOptionsConfig.Output(display_name="family_options",
                                                tooltip="For Train LoRA's family_options input.")],
        )

    @classmethod
    def execute(cls, family: str | dict, **flat: Any) -> io.NodeOutput:
        return io.NodeOutput(chosen_options(family, flat))


def run_family_options(family: str, settings: Mapping[str, Any],
                       chosen: FamilyOptions | None) -> tuple[dict[str, Any], list[str], list[str]]:
    """``(options, problems, notes)`` of a run of a ``family`` model: Train LoRA's widgets of the family's
    option names (``settings``), replaced by the Family Options node's values when it is connected, then
    checked by the family's own option type."""
    options_type = adapter_for(family).options_type
    options = options_from_inputs(options_type, settings)
    problems: list[str] = []
    notes: list[str] = []
    if chosen is not None:
        options, problems, notes = chosen.merged(family, options)
    return options, problems + parse_family_options(family, options_type, options)[1], notes

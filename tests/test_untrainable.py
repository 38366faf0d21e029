"""ComfyUI models PipeTrainer cannot train are refused by name with the reason (training/pipelines/base.py
``refuse_model_class``), not with the generic "not supported yet" of a model no family knows."""

from __future__ import annotations

import pytest

REFUSED = {  # ComfyUI model class -> a fragment of the reason its family module gives
    "HiDreamO1": "pixel-space",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_an_untrainable_model_is_refused_by_name_with_its_reason(name, comfy_root):
    import comfy.model_base
    from pipetrainer.training.pipelines.base import UnknownFamilyError, family_name_for

    cls = getattr(comfy.model_base, name, None)
    if cls is None:
        pytest.skip(f"this ComfyUI has no comfy.model_base.{name}")
    model = cls.__new__(cls)  # the class is all the lookup reads: no weights, no config
    with pytest.raises(UnknownFamilyError) as err:
        family_name_for(model)
    assert f"cannot train {name} models:" in str(err.value) and REFUSED[name] in str(err.value)


def test_an_unknown_model_still_lists_the_supported_families(comfy_root):
    import comfy.model_base
    from pipetrainer.training.pipelines.base import UnknownFamilyError, family_name_for

    cls = comfy.model_base.StableCascade_C  # a ComfyUI model no family claims nor refuses by name
    with pytest.raises(UnknownFamilyError, match="Supported model families: .*SD3"):
        family_name_for(cls.__new__(cls))

"""Preflight's disk estimate counts each adapter type's real parameters (training/adapters/size.py).

Oracle: the file the engine actually writes. For each type (and both LoKr layouts, a LoKr factor, a
block range) the tiny MMDiT gets the run's adapters by the trainer's injection, the engine's save
function builds the file's tensors, and safetensors writes them; the estimate's count must equal the
file's adapter elements (every tensor but the scalar ``alpha``), and those elements times the saved
dtype's size are the file's bytes less its header. The old ``rank * (in + out)`` rule is kept as a
check that the cases tell the types apart (LoHa doubles it, LoKr is far below it).
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

CASES = {  # id: LoraSpec fields
    "lora": dict(adapter="lora", rank=4),
    "lokr-decomposed": dict(adapter="lokr", rank=4),
    "lokr-whole": dict(adapter="lokr", rank=64),
    "lokr-factor4": dict(adapter="lokr", rank=4, factor=4),
    "loha": dict(adapter="loha", rank=4),
    "lora-blocks": dict(adapter="lora", rank=8, blocks="1-2"),
}


@pytest.fixture(scope="module")
def mmdit(fixture_paths):
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(fixture_paths.mmdit))


def _saved_file(mmdit, lora, path) -> None:
    """The adapter file of a 1-stage run of the tiny MMDiT, as the engine saves it (fresh values: the
    element count does not depend on them)."""
    import copy

    from pipetrainer.training.adapters.inject import inject_lora
    from pipetrainer.training.adapters.lora_file import atomic_save, stage_lora_tensors
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.pipelines.targets import run_target_regex

    family = adapter_for("SD3")
    dm = copy.deepcopy(mmdit.model.diffusion_model)
    indexed = [(i + 1, layer) for i, layer in enumerate(family.stage_layers(dm))]
    assert inject_lora(indexed, run_target_regex(family, dm, lora), lora, seed=0) > 0
    stage = torch.nn.ModuleDict({str(i): layer for i, layer in indexed})
    atomic_save(stage_lora_tensors(stage, {i: layer.comfy_paths for i, layer in indexed}, lora), path, {})


def _file_counts(path) -> tuple[int, int, int]:
    """(adapter elements, their bytes, bytes of the file less its header) from the safetensors header."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    elements = nbytes = 0
    for key, info in header.items():
        if key == "__metadata__" or key.endswith(".alpha"):
            continue
        n = 1
        for d in info["shape"]:
            n *= d
        elements += n
        nbytes += info["data_offsets"][1] - info["data_offsets"][0]
    alpha_bytes = sum(4 for key in header if key.endswith(".alpha"))
    return elements, nbytes, len(raw) - 8 - header_len - alpha_bytes


@pytest.mark.parametrize("case", list(CASES))
def test_the_estimate_counts_the_parameters_the_saved_file_holds(case, mmdit, tmp_path):
    from pipetrainer.nodes.checks.preflight import lora_parameter_count
    from pipetrainer.training.pipelines import checks
    from pipetrainer.training.spec.options import LoraSpec

    lora = LoraSpec(targets="all_linear", save_dtype="bf16", alpha=4.0, **CASES[case])
    path = tmp_path / "adapter.safetensors"
    _saved_file(mmdit, lora, path)
    elements, nbytes, data_bytes = _file_counts(path)
    estimate = lora_parameter_count(mmdit, lora)
    assert estimate == elements
    assert nbytes == data_bytes == 2 * elements  # bf16: the file is its elements plus the header
    lora_rule = checks.lora_parameter_count(mmdit.model, lora.rank, lora.targets)
    if lora.adapter == "loha":
        assert estimate == 2 * lora_rule
    elif lora.adapter == "lokr":
        assert estimate < lora_rule / 2
    elif lora.blocks:
        assert 0 < estimate < lora_rule  # two of the four joint blocks
    else:
        assert estimate == lora_rule


def _peft_count(lora, fan_in: int, fan_out: int) -> int:
    """The oracle: the parameters PEFT itself gives a Linear of that shape with the type's registry config
    (on the meta device: nothing allocated)."""
    from peft import inject_adapter_in_model
    from pipetrainer.training.adapters.kinds import adapter_kind, split_adapter_name

    kind = adapter_kind(lora.adapter)
    with torch.device("meta"):
        holder = torch.nn.Module()
        holder.target = torch.nn.Linear(fan_in, fan_out)
        inject_adapter_in_model(kind.peft_config(lora, "target"), holder)
    return sum(p.numel() for n, p in holder.named_parameters()
               if (split := split_adapter_name(n)) is not None and split[1] in kind.factors)


SHAPES = [(3072, 3072), (3072, 12288), (15360, 3072), (2304, 3840), (64, 96), (768, 256), (1, 1), (7, 13),
          (49, 121), (3584, 3072), (5120, 5120), (36, 1536)]


@pytest.mark.parametrize("adapter, ranks, factors", [
    ("lora", (1, 16), (-1,)), ("loha", (1, 16), (-1,)), ("lokr", (1, 4, 16, 64, 256), (-1, 2, 4, 8, 16, 100)),
])
def test_each_type_s_count_rule_is_peft_s_own_layer(adapter, ranks, factors):
    """The rules preflight uses (no PEFT in the ComfyUI process) against PEFT's layers, over shapes
    with square, prime, lopsided and full-size dims, ranks around LoKr's whole-or-decomposed switch and
    factors that do and do not divide."""
    from pipetrainer.training.adapters.kinds import REGISTRY
    from pipetrainer.training.adapters.size import PER_LINEAR
    from pipetrainer.training.spec.options import LoraSpec

    assert set(PER_LINEAR) == set(REGISTRY)
    for rank in ranks:
        for factor in factors:
            lora = LoraSpec(adapter=adapter, rank=rank, alpha=float(rank), factor=factor)
            for fan_in, fan_out in SHAPES:
                assert PER_LINEAR[adapter](fan_in, fan_out, lora) == _peft_count(lora, fan_in, fan_out), \
                    (adapter, rank, factor, fan_in, fan_out)

"""The LoRA Adapter's ``blocks`` range: parsing, the numbering over block lists, which Linears get adapters.

The oracle for "only the named blocks get adapters" is independent of the restricted regex: the family's
plain preset over ``named_modules`` of the ComfyUI model, filtered by the path prefix of each chosen block.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

FLUX_DEV_LISTS = [("double_blocks", 19), ("single_blocks", 38)]


def test_plain_numbers_count_through_the_lists_and_named_items_use_each_lists_own():
    from pipetrainer.training.adapters.block_range import parse_blocks, resolve_blocks

    assert resolve_blocks("", FLUX_DEV_LISTS) == {"double_blocks": frozenset(range(19)),
                                                  "single_blocks": frozenset(range(38))}
    chosen = resolve_blocks(" 17-20 ,0", FLUX_DEV_LISTS)
    assert chosen == {"double_blocks": {0, 17, 18}, "single_blocks": {0, 1}}
    chosen = resolve_blocks("double:0-1, single_blocks:37", FLUX_DEV_LISTS)
    assert chosen == {"double_blocks": {0, 1}, "single_blocks": {37}}
    assert resolve_blocks("56", FLUX_DEV_LISTS) == {"double_blocks": set(), "single_blocks": {37}}
    assert [i.text() for i in parse_blocks("1 - 3, single:4")] == ["1-3", "single:4"]


@pytest.mark.parametrize("text, words", [
    ("57", ["57 blocks", "double_blocks 0-18 (= 0-18)", "single_blocks 0-37 (= 19-56)", "0-56"]),
    ("single:38", ["single_blocks's 38 blocks", "0-37"]),
    ("triple:1", ["'triple' names none", "double_blocks, single_blocks"]),
    ("blocks:1", ["matches several"]),
    ("3-1", ["backwards", "1-3"]),
    ("a-b", ["'a-b'", "0-9, 20"]),
    ("1,,2", ["empty item"]),
])
def test_bad_ranges_name_the_counts_or_the_fix(text, words):
    from pipetrainer.training.adapters.block_range import BlockRangeError, resolve_blocks

    with pytest.raises(BlockRangeError) as info:
        resolve_blocks(text, [("double_blocks", 19), ("single_blocks", 38)] if text != "blocks:1" else
                       [("blocks_a", 2), ("blocks_b", 2)])
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_restricted_regex_keeps_the_preset_and_only_the_chosen_blocks():
    from pipetrainer.training.adapters.block_range import restrict_regex

    regex = restrict_regex(r"(double_blocks|single_blocks)\.\d+\.(img_attn\.qkv|linear1)",
                           {"double_blocks": frozenset({1}), "single_blocks": frozenset({0, 10})})
    def hit(p): return re.fullmatch(regex, p) is not None
    assert hit("double_blocks.1.img_attn.qkv") and hit("single_blocks.10.linear1") and hit("single_blocks.0.linear1")
    assert not hit("double_blocks.10.img_attn.qkv") and not hit("single_blocks.1.linear1")
    assert not hit("double_blocks.1.img_mlp.0")  # outside the preset
    assert not hit("double_blocks.11.img_attn.qkv")  # "1" is not a prefix match of "11"
    assert re.fullmatch(restrict_regex("x", {"a": frozenset()}), "x") is None


def _oracle(dm, preset_regex, prefixes):
    """Linear paths of the preset under the given block prefixes (no restricted regex involved)."""
    return {n for n, m in dm.named_modules() if isinstance(m, torch.nn.Linear) and re.fullmatch(preset_regex, n)
            and any(n.startswith(p + ".") for p in prefixes)}


def test_only_the_named_blocks_of_the_mmdit_get_adapters(fixture_paths):
    import comfy.sd
    from pipetrainer.training.adapters.inject import inject_lora, named_lora_parameters
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.pipelines.targets import block_lists, run_target_regex
    from pipetrainer.training.spec.options import LoraSpec

    patcher = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit))
    family, dm = adapter_for("SD3"), patcher.model.diffusion_model
    assert block_lists(family, dm) == [("joint_blocks", 4)]
    lora = LoraSpec(rank=2, alpha=2.0, targets="attention_mlp", blocks="1-2")
    expected = _oracle(dm, family.lora_target_regex("attention_mlp"), ["joint_blocks.1", "joint_blocks.2"])
    assert expected and len(expected) < len(_oracle(dm, family.lora_target_regex("attention_mlp"), ["joint_blocks"]))
    layers = [(i + 1, layer) for i, layer in enumerate(family.stage_layers(dm))]
    count = inject_lora(layers, run_target_regex(family, dm, lora), lora, seed=0)
    assert count == len(expected)
    stage = torch.nn.ModuleDict({str(i): layer for i, layer in layers})
    wrapped = {layer.comfy_path(n.partition(".")[2].split(".lora_")[0]) for n in named_lora_parameters(stage)
               for layer in [stage[n.split(".")[0]]]}
    assert wrapped == expected


def test_two_block_lists_share_one_numbering(comfy_root, fixture_paths):
    """HunyuanVideo (1 double + 1 single block): '1' is the single block, 'double:0' the double one."""
    from pipetrainer.tests.family_rows import all_rows
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.pipelines.targets import block_lists, model_targets, run_target_regex
    from pipetrainer.training.spec.options import LoraSpec

    (row,) = [r for r in all_rows() if r.name == "HunyuanVideo"]
    model = row.load(comfy_root, fixture_paths)
    base = getattr(model, "model", model)
    family, dm = adapter_for("HunyuanVideo"), base.diffusion_model
    assert block_lists(family, dm) == [("double_blocks", 1), ("single_blocks", 1)]
    preset = family.lora_target_regex("attention")
    for text, prefix in (("1", "single_blocks.0"), ("double:0", "double_blocks.0"), ("single_blocks:0", "single_blocks.0")):
        got = set(model_targets(dm, run_target_regex(family, dm, LoraSpec(targets="attention", blocks=text))))
        assert got == _oracle(dm, preset, [prefix]) != set(), text


def test_an_out_of_range_block_is_a_preflight_error_naming_the_count(fixture_paths):
    import comfy.sd
    from pipetrainer.training.adapters.problems import adapter_target_problems
    from pipetrainer.training.spec.options import LoraSpec

    model = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit)).model
    (problem,) = adapter_target_problems(model, LoraSpec(blocks="2-4"))
    assert "4 blocks" in problem and "joint_blocks 0-3" in problem and "'2-4'" in problem
    (problem,) = adapter_target_problems(model, LoraSpec(blocks="joint:7"))
    assert "joint_blocks's 4 blocks" in problem
    assert adapter_target_problems(model, LoraSpec(blocks="joint:3")) == []


def test_blocks_syntax_is_a_spec_and_node_problem_and_part_of_the_training_hash(tmp_path, comfy_root):
    from pipetrainer.nodes.lora_adapter import PipeTrainerLoRA
    from pipetrainer.nodes.node_problems import NodeProblems
    from pipetrainer.training.spec.options import LoraSpec
    from pipetrainer.training.spec.run_spec import RunSpec

    assert any("not a block number" in p for p in LoraSpec(blocks="0-x").problems())
    with pytest.raises(NodeProblems, match="not a block number"):
        PipeTrainerLoRA.validate_inputs(blocks="first two")
    assert PipeTrainerLoRA.validate_inputs(blocks="0-3, single:1") is True
    out = PipeTrainerLoRA.execute(8, 8.0, 0.0, "attention", blocks=" 0 -3 ,single:1").args[0]
    assert out.blocks == "0-3, single:1"  # canonical text: spacing does not change the hash

    from pipetrainer.tests.test_adapters import _run_spec

    spec = _run_spec(tmp_path, LoraSpec(rank=4, alpha=2.0))
    old = spec.to_dict()
    for name in ("blocks", "init_lora", "init_lora_digest"):
        del old["lora"][name]  # a spec written before these fields existed keeps its hash
    assert RunSpec.from_dict(old).training_hash() == spec.training_hash()
    ranged = dataclasses.replace(spec, lora=dataclasses.replace(spec.lora, blocks="0-1"))
    assert ranged.training_hash() != spec.training_hash()

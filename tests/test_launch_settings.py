"""The training process runs the way the user launched ComfyUI: attention, precision, memory flags, GPUs.

Fast tier: the flags read from ComfyUI's own parser, the spec round trip and validation, the rank's plan
(fallbacks and the "node wins" precision rule, each with its note), ComfyUI's switches taking effect in
a fresh process, the backward pass of ComfyUI's flash op, ``gpus`` parsing and the preflight messages,
the rank environment and the cluster bundle. Slow tier: real ComfyUI servers launched with the flags.

flash-attn builds only against CUDA, so on this CPU machine a stand-in package (written by
:func:`_flash_standin`) provides ``flash_attn_func`` computed with PyTorch SDPA, in flash-attn's
(batch, tokens, heads, dim) layout. It is what lets a real ComfyUI start with ``--use-flash-attention``
here (ComfyUI exits at start when the package is missing) and what ComfyUI's real flash op calls.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch  # module scope: torch.library reads the custom op's (string) annotations from here
from pipetrainer.training.model.launch_settings import LaunchSettings, cuda_names, plan_rank_args, settings_from_args
from pipetrainer.training.spec.choices import SpecError
from pipetrainer.training.spec.run_spec import RunSpec

PACK_DIR = Path(__file__).resolve().parent.parent
GIB = 2**30


def _comfy_args(*flags: str):
    """A namespace parsed by ComfyUI's own parser, with ComfyUI's ``--fast`` normalisation."""
    import comfy.cli_args

    args = comfy.cli_args.parser.parse_args(list(flags))
    args.fast = set(args.fast or ())
    return args


# ---- reading the flags --------------------------------------------------------------------------
def test_settings_are_read_from_comfyuis_parsed_args(comfy_root):
    args = _comfy_args("--use-flash-attention", "--force-fp32", "--fast", "fp16_accumulation", "autotune",
                       "--lowvram", "--reserve-vram", "1.5", "--cuda-device", "1", "--deterministic")
    s = settings_from_args(args, {"CUDA_VISIBLE_DEVICES": "1"}, gpus=(0,))
    assert (s.attention, s.force_fp32, s.fast, s.vram_mode) == ("flash", True, ("autotune", "fp16_accumulation"), "lowvram")
    assert (s.reserve_vram_gb, s.cuda_device, s.deterministic) == (1.5, "1", True)
    assert (s.gpus, s.cuda_visible_devices) == ((0,), "1")  # ComfyUI's GPU 0 is CUDA's device 1 here
    assert s.as_flags() == ["--use-flash-attention", "--force-fp32", "--deterministic", "--fast", "autotune",
                            "fp16_accumulation", "--lowvram", "--reserve-vram", "1.5", "--cuda-device", "1"]
    default = settings_from_args(_comfy_args(), {})
    assert default == LaunchSettings() and default.as_flags() == []


def test_unet_flags_and_what_comfyui_picked(comfy_root):
    assert settings_from_args(_comfy_args("--bf16-unet"), {}).unet_precision == "bf16"
    assert settings_from_args(_comfy_args("--fp8_e4m3fn-unet"), {}).unet_precision == "fp8_e4m3fn"
    forced = settings_from_args(_comfy_args("--force-fp16"), {})  # ComfyUI's parser implies fp16_unet
    forced_args = _comfy_args("--force-fp16")
    forced_args.fp16_unet = True
    assert settings_from_args(forced_args, {}) == forced and (forced.force_fp16, forced.unet_precision) == (True, "")
    # No flag, but ComfyUI runs flash (or sage): that is what the user gets, so that is what is recorded.
    assert settings_from_args(_comfy_args(), {}, picked_attention="attention_flash").attention == "flash"
    assert settings_from_args(_comfy_args(), {}, picked_attention="attention_pytorch").attention == "auto"


def test_cuda_names_follow_comfyuis_visible_devices():
    assert cuda_names((0, 1), None) == "0,1"
    assert cuda_names((1, 0), "3,5") == "5,3"
    assert cuda_names((0,), "GPU-8f2a") == "GPU-8f2a"
    with pytest.raises(ValueError, match="not in CUDA_VISIBLE_DEVICES"):
        cuda_names((2,), "3,5")


# ---- the spec -------------------------------------------------------------------------------------
def _base_spec(tmp_path: Path) -> RunSpec:
    from pipetrainer.training.spec.options import CacheItem, LoraSpec, ModelRecipe, OptimizerSpec, TrainSpec

    return RunSpec(
        model=ModelRecipe("diffusion_model", str(tmp_path / "m.safetensors")),
        items=(CacheItem(str(tmp_path / "l.safetensors"), str(tmp_path / "t.safetensors"), "a.png", "a"),),
        lora=LoraSpec(), optimizer=OptimizerSpec(), train=TrainSpec(pipeline_stages=2),
        run_dir=str(tmp_path / "run"), lora_output=str(tmp_path / "x.safetensors"), comfyui_path=str(tmp_path),
    )


def test_spec_records_launch_settings_and_round_trips(tmp_path):
    launch = LaunchSettings(attention="flash", force_fp32=True, fast=("autotune",), reserve_vram_gb=2.0,
                            vram_mode="highvram", gpus=(3, 1), cuda_visible_devices="3,1", cuda_device_order="PCI_BUS_ID")
    spec = dataclasses.replace(_base_spec(tmp_path), device="cuda", launch=launch).validated()
    data = json.loads(spec.to_json())
    assert data["launch"]["attention"] == "flash" and data["launch"]["gpus"] == [3, 1]
    again = RunSpec.from_json(spec.to_json())
    assert again == spec and again.launch == launch
    # Launch settings move how a run computes on this machine, never the trained weights' identity.
    assert again.training_hash() == _base_spec(tmp_path).training_hash()
    # A spec written before launch settings existed loads with ComfyUI's defaults.
    del data["launch"]
    assert RunSpec.from_dict(data).launch == LaunchSettings()
    data["launch"] = {"attention": "flash", "warp_drive": True}
    with pytest.raises(ValueError, match="warp_drive"):
        RunSpec.from_dict(data)


def test_spec_validation_names_each_launch_problem(tmp_path):
    base = _base_spec(tmp_path)
    bad = LaunchSettings(attention="xformers2", unet_precision="fp4", vram_mode="hugevram", fast=("Fast!",),
                         reserve_vram_gb=-1.0)
    with pytest.raises(SpecError) as err:
        dataclasses.replace(base, launch=bad).validated()
    text = str(err.value)
    for word in ("xformers2", "fp4", "hugevram", "Fast!", "reserve_vram_gb"):
        assert word in text
    on_cpu = LaunchSettings(gpus=(0, 1), cuda_visible_devices="0,1")
    assert any("trains on cpu" in p for p in dataclasses.replace(base, launch=on_cpu).problems())
    three = LaunchSettings(gpus=(0, 1, 2), cuda_visible_devices="0,1,2")
    assert any("2 rank(s)" in p for p in dataclasses.replace(base, device="cuda", launch=three).problems())
    twice = LaunchSettings(gpus=(1, 1), cuda_visible_devices="1,1")
    assert any("twice" in p for p in dataclasses.replace(base, device="cuda", launch=twice).problems())
    assert dataclasses.replace(base, device="cuda", launch=LaunchSettings(gpus=(0, 1), cuda_visible_devices="0,1")).problems() == []


# ---- the rank's plan --------------------------------------------------------------------------------
def _plan(settings: LaunchSettings, **facts):
    kwargs = {"device": "cuda", "train_dtype": "bf16", "flash_installed": True, "capability": (9, 0), **facts}
    return plan_rank_args(settings, **kwargs)


def test_flash_is_used_when_it_can_train():
    plan = _plan(LaunchSettings(attention="flash"))
    assert plan.attention == "flash" and plan.notes == ()
    assert plan.comfy_args["use_flash_attention"] and not plan.comfy_args["use_pytorch_cross_attention"]
    assert plan.comfy_args["cpu"] is False


@pytest.mark.parametrize("facts, reason", [
    ({"device": "cpu", "capability": None}, "trains on the CPU"),
    ({"flash_installed": False}, "not installed"),
    ({"train_dtype": "fp32"}, "training_dtype is fp32"),
    ({"capability": (7, 5)}, "compute capability 7.5"),
])
def test_flash_falls_back_to_sdpa_with_one_note(facts, reason):
    plan = _plan(LaunchSettings(attention="flash"), **facts)
    assert plan.attention == "pytorch"
    assert plan.comfy_args["use_pytorch_cross_attention"] and not plan.comfy_args["use_flash_attention"]
    [note] = plan.notes
    assert reason in note and "--use-flash-attention" in note and "uses PyTorch SDPA instead" in note


def test_sage_cannot_train_and_says_so():
    plan = _plan(LaunchSettings(attention="sage"))
    assert plan.attention == "pytorch" and not plan.comfy_args["use_sage_attention"]
    [note] = plan.notes
    assert "no backward" in note and "SDPA" in note


def test_other_backends_pass_through_and_auto_sets_no_flag():
    for name in ("pytorch", "split", "quad"):
        plan = _plan(LaunchSettings(attention=name), device="cpu")
        assert plan.attention == name and plan.notes == ()
    auto = _plan(LaunchSettings(), device="cpu")
    assert not any(auto.comfy_args[f] for f in ("use_pytorch_cross_attention", "use_flash_attention",
                                                "use_sage_attention", "use_split_cross_attention",
                                                "use_quad_cross_attention"))


@pytest.mark.parametrize("settings, train_dtype, weight_dtype, expect", [
    (LaunchSettings(force_fp32=True), "bf16", "default", "--force-fp32 but training_dtype is bf16"),
    (LaunchSettings(unet_precision="bf16"), "fp32", "default", "--bf16-unet but training_dtype is fp32"),
    (LaunchSettings(unet_precision="fp16"), "bf16", "default", "--fp16-unet but training_dtype is bf16"),
    (LaunchSettings(force_fp16=True), "bf16", "default", "--force-fp16"),
    (LaunchSettings(unet_precision="fp8_e4m3fn"), "bf16", "default", "Choose weight_dtype fp8_e4m3fn"),
    (LaunchSettings(fast=("fp8_matrix_mult",)), "bf16", "fp8_e4m3fn", "no backward"),
    (LaunchSettings(supports_fp8_compute=True), "bf16", "fp8_e4m3fn", "--supports-fp8-compute"),
])
def test_conflicting_precision_flags_give_way_to_the_node_with_a_note(settings, train_dtype, weight_dtype, expect):
    plan = plan_rank_args(settings, device="cuda", train_dtype=train_dtype, weight_dtype=weight_dtype)
    [note] = plan.notes
    assert expect in note
    assert "fp8_matrix_mult" not in plan.comfy_args["fast"] and plan.comfy_args["supports_fp8_compute"] is False


@pytest.mark.parametrize("settings, train_dtype, weight_dtype", [
    (LaunchSettings(force_fp32=True), "fp32", "default"),
    (LaunchSettings(unet_precision="bf16"), "bf16", "default"),
    (LaunchSettings(unet_precision="fp8_e4m3fn"), "bf16", "fp8_e4m3fn"),
    (LaunchSettings(fast=("fp16_accumulation", "autotune")), "bf16", "default"),
])
def test_agreeing_flags_are_applied_without_a_note(settings, train_dtype, weight_dtype):
    plan = plan_rank_args(settings, device="cuda", train_dtype=train_dtype, weight_dtype=weight_dtype)
    assert plan.notes == ()
    assert plan.comfy_args["force_fp32"] == settings.force_fp32
    assert plan.comfy_args["fast"] == settings.fast


def test_memory_modes_apply_on_cuda_only():
    settings = LaunchSettings(vram_mode="lowvram", disable_pinned_memory=True, reserve_vram_gb=2.0)
    cuda = plan_rank_args(settings, device="cuda", train_dtype="bf16").comfy_args
    assert cuda["lowvram"] and not cuda["highvram"] and cuda["reserve_vram"] == 2.0 and cuda["disable_pinned_memory"]
    cpu = plan_rank_args(settings, device="cpu", train_dtype="bf16").comfy_args
    assert "lowvram" not in cpu and cpu["cpu"] is True  # on CPU, ComfyUI's --cpu is the memory mode
    dynamic = plan_rank_args(LaunchSettings(dynamic_vram="disable"), device="cuda", train_dtype="bf16").comfy_args
    assert dynamic["disable_dynamic_vram"] and not dynamic["enable_dynamic_vram"]


@pytest.mark.parametrize("mode", ["highvram", "gpu_only"])
def test_whole_model_vram_modes_are_never_replayed_to_the_ranks_and_the_log_says_so(mode):
    """With --highvram / --gpu-only ComfyUI's loader keeps the whole model on the GPU: every rank would hold
    the whole model, even with 2 stages. The ranks run in ComfyUI's normal mode and the run log says why."""
    plan = plan_rank_args(LaunchSettings(vram_mode=mode), device="cuda", train_dtype="bf16")
    assert not any(plan.comfy_args[m] for m in ("gpu_only", "highvram", "lowvram", "novram", "normalvram"))
    flag = "--" + mode.replace("_", "-")
    assert [n for n in plan.notes if flag in n and "whole model on every rank's GPU" in n], plan.notes
    assert not [n for n in plan_rank_args(LaunchSettings(vram_mode="lowvram"), device="cuda",
                                          train_dtype="bf16").notes if "whole model" in n]


def test_dynamic_vram_flags_of_current_comfyui(comfy_root):
    import comfy.cli_args

    if not hasattr(comfy.cli_args.args, "disable_dynamic_vram"):
        pytest.skip("this ComfyUI has no dynamic VRAM (added after 0.3.75)")
    s = settings_from_args(_comfy_args("--disable-dynamic-vram"), {})
    assert s.dynamic_vram == "disable" and s.as_flags() == ["--disable-dynamic-vram"]


# ---- ComfyUI's switches in a fresh process --------------------------------------------------------
def _flash_standin(folder: Path) -> Path:
    """A ``flash_attn`` package whose ``flash_attn_func`` is SDPA in flash-attn's layout (see the module doc)."""
    package = folder / "flash_attn"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(textwrap.dedent('''
        """Test stand-in for flash-attn on a CPU machine: flash_attn_func computed by PyTorch SDPA."""
        import torch

        def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
                is_causal=causal, scale=softmax_scale)
            return out.transpose(1, 2)
        '''))
    return folder


def _run_python(code: str, comfy_root: Path, extra_path: Path | None = None) -> dict:
    """Run ``code`` in a fresh Python with the pack imported; it prints one JSON line last."""
    prelude = textwrap.dedent(f'''
        import importlib.util, json, sys
        _s = importlib.util.spec_from_file_location("_e", {str(PACK_DIR / "training" / "process" / "entry.py")!r})
        _m = importlib.util.module_from_spec(_s); _s.loader.exec_module(_m); _m.import_pack()
        ROOT = {str(comfy_root)!r}
        ''')
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


SWITCH_PROBE = '''
    from pipetrainer.training.model.comfy_env import attention_in_use, comfy_args_report, use_comfyui
    from pipetrainer.training.model.launch_settings import LaunchSettings, plan_rank_args
    plan = plan_rank_args(LaunchSettings(**json.loads({settings!r})), device="cpu", train_dtype="fp32")
    use_comfyui(ROOT, "cpu", plan.comfy_args)
    import comfy.model_management as mm
    print(json.dumps({{"attention": attention_in_use(), "force_fp32": mm.FORCE_FP32,
                      "args": comfy_args_report(["use_pytorch_cross_attention", "force_fp32", "cpu"])}}))
'''


def test_comfyuis_own_switches_take_effect_in_a_fresh_process(comfy_root):
    chosen = _run_python(SWITCH_PROBE.format(settings=json.dumps({"attention": "pytorch", "force_fp32": True})), comfy_root)
    assert chosen == {"attention": "attention_pytorch", "force_fp32": True,
                      "args": {"use_pytorch_cross_attention": True, "force_fp32": True, "cpu": True}}
    default = _run_python(SWITCH_PROBE.format(settings=json.dumps({})), comfy_root)
    assert default["attention"] == "attention_sub_quad" and default["force_fp32"] is False  # ComfyUI's CPU default


PRECISION_PROBE = '''
    import torch
    from pipetrainer.training.model.comfy_env import use_comfyui
    from pipetrainer.training.model.launch_settings import LaunchSettings, plan_rank_args
    from pipetrainer.training.model.model_source import load_model
    from pipetrainer.training.spec.options import ModelRecipe
    plan = plan_rank_args(LaunchSettings(unet_precision="bf16"), device="cpu", train_dtype="fp32")
    use_comfyui(ROOT, "cpu", plan.comfy_args)
    import comfy.sd
    graph = comfy.sd.load_diffusion_model({model!r})  # what the ComfyUI process would load under the flags
    trained = load_model(ModelRecipe("diffusion_model", {model!r}), "fp32")
    print(json.dumps({{"graph": str(graph.model.get_dtype()), "trained": str(trained.model.get_dtype()),
                      "cast": str(trained.model.manual_cast_dtype), "notes": len(plan.notes)}}))
'''


def test_precision_flags_take_effect_but_the_train_nodes_dtype_wins(comfy_root, fixture_paths):
    result = _run_python(PRECISION_PROBE.format(model=str(fixture_paths.mmdit)), comfy_root)
    # --bf16-unet makes ComfyUI's own loader store bf16 here; training_dtype fp32 still trains in fp32.
    assert result == {"graph": "torch.bfloat16", "trained": "torch.float32", "cast": "None", "notes": 1}


def test_settings_after_comfyui_loaded_are_refused(comfy_root):
    from pipetrainer.training.model.comfy_env import use_comfyui

    assert use_comfyui(comfy_root, "cpu") == []  # ComfyUI is loaded here: plain calls stay harmless
    with pytest.raises(RuntimeError, match="already imported"):
        use_comfyui(comfy_root, "cpu", {"use_flash_attention": True})


FLASH_BACKWARD_PROBE = '''
    import torch
    from pipetrainer.training.model.comfy_env import use_comfyui
    use_comfyui(ROOT, "cpu", {"use_flash_attention": True})  # ComfyUI's own switch, as the flag sets it
    import comfy.ldm.modules.attention as attention
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 24, 4 * 16, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 24, 4 * 16)
    result = {"attention": attention.optimized_attention.__name__}
    try:
        torch.autograd.grad(attention.optimized_attention(q, k, v, heads=4), (q, k, v), grad)
        result["before"] = "ok"
    except RuntimeError as exc:
        result["before"] = str(exc)
    from pipetrainer.patches.comfy_flash_backward import enable_flash_attention_backward
    result["registered"] = enable_flash_attention_backward()
    out = attention.optimized_attention(q, k, v, heads=4)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref_out = attention.attention_pytorch(q, k, v, heads=4)
    ref = torch.autograd.grad(ref_out, (q, k, v), grad)
    result["out_diff"] = (out - ref_out).abs().max().item()
    result["grad_diff"] = max((a - b).abs().max().item() for a, b in zip(got, ref))
    result["grad_norm"] = sum(g.norm().item() for g in got)
    print(json.dumps(result))
'''


def test_comfyuis_flash_op_trains_with_the_registered_backward(comfy_root, tmp_path):
    """ComfyUI's ``--use-flash-attention`` switch selects its flash op, which has no backward of its own;
    after :func:`enable_flash_attention_backward` its gradients are SDPA's (the stand-in computes SDPA)."""
    result = _run_python(FLASH_BACKWARD_PROBE, comfy_root, _flash_standin(tmp_path / "site"))
    assert result["attention"] == "attention_flash"
    assert "no autograd formula" in result["before"]
    assert result["registered"] is True
    assert result["out_diff"] < 1e-6 and result["grad_diff"] < 1e-5 and result["grad_norm"] > 1.0


def test_recompute_backward_matches_autograd_on_a_custom_op():
    from pipetrainer.patches.comfy_flash_backward import register_recompute_backward

    def attend(q, k, v, dropout_p: float = 0.0, causal: bool = False):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    @torch.library.custom_op(f"pipetrainer_test::attn_{uuid.uuid4().hex[:8]}", mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, causal: bool = False) -> torch.Tensor:
        return attend(q, k, v, dropout_p, causal)

    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    with pytest.raises(RuntimeError, match="no autograd formula"):
        op(q, k, v, 0.0, True).sum().backward()
    register_recompute_backward(op, attend)
    got = torch.autograd.grad(op(q, k, v, 0.0, True).sum(), (q, k, v))
    want = torch.autograd.grad(attend(q, k, v, 0.0, True).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


# ---- gpus ---------------------------------------------------------------------------------------------
def _gpus(*free_used: tuple[float, float]):
    from pipetrainer.nodes.checks.gpus import GpuInfo

    return [GpuInfo(i, "NVIDIA H100", int(free * GIB), int((free + used) * GIB)) for i, (free, used) in enumerate(free_used)]


def test_gpus_parsing():
    from pipetrainer.nodes.checks.gpus import parse_gpus

    assert parse_gpus("") == ((), [])
    assert parse_gpus("0,1, 3") == ((0, 1, 3), [])
    assert parse_gpus(" 2 0 ") == ((2, 0), [])
    gpus, [problem] = parse_gpus("0,cuda:1,-2")
    assert gpus == () and "'cuda:1'" in problem and "'-2'" in problem
    gpus, [problem] = parse_gpus("1,1,2")
    assert gpus == () and "GPU 1 more than once" in problem


def test_gpu_selection_and_its_messages():
    from pipetrainer.nodes.checks.gpus import select_gpus

    visible = _gpus((70.0, 9.5), (40.0, 39.5))
    assert select_gpus((), 2, visible) == ((0, 1), [])
    assert select_gpus((), 1, visible) == ((0,), [])
    assert select_gpus((1, 0), 2, visible) == ((1, 0), [])
    _, [too_few] = select_gpus((), 4, visible)
    assert "4 ranks need 4 GPUs" in too_few
    assert "GPU 0 (NVIDIA H100: 70.0 GiB free, 9.5 GiB used of 79.5 GiB)" in too_few
    assert "GPU 1 (NVIDIA H100: 40.0 GiB free, 39.5 GiB used of 79.5 GiB)" in too_few
    _, [short] = select_gpus((1,), 2, visible)
    assert "lists 1 GPU(s)" in short and "exactly 2" in short and "40.0 GiB free" in short
    _, [extra] = select_gpus((0, 1), 1, visible)
    assert "exactly 1" in extra and "raise pipeline_stages" in extra
    _, [missing] = select_gpus((0, 5), 2, visible)
    assert "GPU 5, which ComfyUI cannot see" in missing and "GPU 0 (NVIDIA H100" in missing and "GPU 1 (" in missing


def test_gpus_on_cpu_and_the_run_log_table(comfy_root):
    from pipetrainer.nodes.checks.gpus import cpu_gpus_problems, gpu_table
    from pipetrainer.nodes.checks.launch import resolve_gpus
    from pipetrainer.nodes.checks.preflight import gpu_problems
    from pipetrainer.training.spec.options import TrainSpec

    assert cpu_gpus_problems("") == []
    [problem] = cpu_gpus_problems("0,1")
    assert "runs on the CPU" in problem
    assert gpu_problems(TrainSpec(), "0") == [problem.replace("'0,1'", "'0'")]  # ComfyUI runs on CPU here
    assert gpu_problems(TrainSpec(), "") == []
    assert resolve_gpus("0,7", 2, "cuda", _gpus((1.0, 1.0), (1.0, 1.0)))[1][0].startswith("gpus lists GPU 7")
    assert gpu_table((1, 0), _gpus((70.0, 9.5), (40.0, 39.5))).startswith("GPUs: rank 0 -> GPU 1 (NVIDIA H100: 40.0 GiB free")



class _TwoGpusWithoutNvml:
    """What torch.cuda answers on a 2-GPU machine without pynvml, ComfyUI computing on GPU 1; it records which
    GPUs were asked through CUDA (each such question opens a CUDA context on that GPU)."""

    def __init__(self, initialized: bool):
        self.initialized, self.asked = initialized, []

    def is_initialized(self):
        return self.initialized

    def current_device(self):
        return 1

    def device_count(self):
        return 2

    def get_device_properties(self, i):
        return type("Props", (), {"name": "NVIDIA L4", "total_memory": 24 * 2**30})()

    def device_memory_used(self, i):
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    def mem_get_info(self, i):
        self.asked.append(i)
        return 20 * 2**30, 24 * 2**30


def test_without_nvml_only_comfyuis_own_gpu_is_asked_for_its_memory():
    from pipetrainer.nodes.checks.gpus import visible_gpus

    cuda = _TwoGpusWithoutNvml(initialized=True)
    other, own = visible_gpus(cuda)
    assert cuda.asked == [1]  # no new CUDA context on GPU 0 inside ComfyUI
    assert (own.free_bytes, own.memory_read) == (20 * 2**30, True)
    assert not other.memory_read and "free memory not read: install pynvml" in other.describe()
    cold = _TwoGpusWithoutNvml(initialized=False)
    assert [g.memory_read for g in visible_gpus(cold)] == [False, False] and cold.asked == []


# ---- the rank environment and the cluster bundle -------------------------------------------------------
def test_ranks_get_the_run_gpus_in_rank_order(tmp_path, monkeypatch):
    from pipetrainer.training.process.supervisor import _rank_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # ComfyUI's own, inherited
    launch = LaunchSettings(gpus=(3, 1), cuda_visible_devices="3,1", cuda_device_order="PCI_BUS_ID")
    spec = dataclasses.replace(_base_spec(tmp_path), device="cuda", launch=launch).validated()
    envs = [_rank_env(spec, r, tmp_path / "rdv") for r in range(2)]
    assert [(e["CUDA_VISIBLE_DEVICES"], e["LOCAL_RANK"], e["CUDA_DEVICE_ORDER"]) for e in envs] == [
        ("3,1", "0", "PCI_BUS_ID"), ("3,1", "1", "PCI_BUS_ID")]
    cpu = _rank_env(dataclasses.replace(spec, device="cpu", launch=LaunchSettings()), 0, tmp_path / "rdv")
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""
    legacy = _rank_env(dataclasses.replace(spec, launch=LaunchSettings()), 0, tmp_path / "rdv")
    assert legacy["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # no GPUs chosen: the inherited ones, as before


def test_cuda_ranks_keep_comfyuis_allocator_setting(tmp_path, monkeypatch):
    """ComfyUI's cuda_malloc.py puts ``backend:cudaMallocAsync`` into PYTORCH_CUDA_ALLOC_CONF before torch
    loads; the ranks allocate with the same backend (their block swap frees and refills device memory
    every step, which the stream-ordered allocator serves without fragmenting), and a user's own
    allocator options in that variable reach the ranks unchanged."""
    from pipetrainer.training.process.supervisor import _rank_env

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.8,backend:cudaMallocAsync")
    launch = LaunchSettings(gpus=(0, 1), cuda_visible_devices="0,1")
    spec = dataclasses.replace(_base_spec(tmp_path), device="cuda", launch=launch).validated()
    env = _rank_env(spec, 1, tmp_path / "rdv")
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.8,backend:cudaMallocAsync"


def test_cluster_bundle_carries_the_launch_settings(tmp_path):
    from pipetrainer.training.process.cluster import write_cluster_bundle

    launch = LaunchSettings(attention="flash", unet_precision="bf16", gpus=(2, 3), cuda_visible_devices="2,3")
    spec = dataclasses.replace(_base_spec(tmp_path), device="cuda", launch=launch).validated()
    folder = write_cluster_bundle(spec, PACK_DIR / "training" / "process" / "entry.py")
    assert RunSpec.load(folder / "spec.json").launch == launch
    for script in ("launch_deepspeed.sh", "launch_torchrun.sh"):
        text = (folder / script).read_text()
        assert "applied by every rank from spec.json: --use-flash-attention --bf16-unet" in text
        assert "used CUDA devices 2,3" in text


# ---- real ComfyUI servers launched with the flags (slow) -------------------------------------------
WORKFLOW = PACK_DIR / "workflows" / "api" / "pipetrainer_tiny_mmdit.json"
TRAIN_NODE = "8"


def _train_only(lora_name: str, steps: int, dtype: str) -> dict:
    """The example workflow up to Train LoRA (an output node), without sampling: the run is what is tested."""
    prompt = {k: v for k, v in json.loads(WORKFLOW.read_text()).items() if k in {"1", "2", "3", "4", "5", "6", "7", "8"}}
    prompt[TRAIN_NODE]["inputs"].update(lora_name=lora_name, steps=steps, training_dtype=dtype, resume=False)
    return prompt


def _train_on_server(comfy_root: Path, tmp_path: Path, flags: tuple[str, ...], dtype: str) -> tuple[Path, list[dict], str]:
    from pipetrainer.devkit.host import ComfyServer, history_error
    from pipetrainer.training.process.events import read_all

    name = f"launch_{uuid.uuid4().hex[:6]}"
    with ComfyServer(comfy_root, tmp_path / "comfyui.log", extra_args=flags) as server:
        entry = server.wait(server.queue(_train_only(name, steps=2, dtype=dtype)), timeout=600)
        assert history_error(entry) is None, server.log_tail()
        log = server.log_path.read_text(errors="replace")
    [run_dir] = sorted((comfy_root / "output" / "pipetrainer" / "runs").glob(f"{name}-*"))
    assert (comfy_root / "models" / "loras" / f"{name}.safetensors").exists()
    return run_dir, read_all(run_dir), log


@pytest.mark.slow
def test_a_server_launched_with_sdpa_and_force_fp32_trains_with_both(comfy_root, fixture_paths, tmp_path):
    run_dir, events, _ = _train_on_server(comfy_root, tmp_path, ("--use-pytorch-cross-attention", "--force-fp32"), "bf16")
    launch = RunSpec.load(run_dir / "spec.json").launch
    assert (launch.attention, launch.force_fp32) == ("pytorch", True)
    [effective] = [e for e in events if e["type"] == "comfy_args"]
    assert effective["args"]["use_pytorch_cross_attention"] is True and effective["args"]["force_fp32"] is True
    assert effective["attention"] == "attention_pytorch"
    assert effective["flags"] == ["--use-pytorch-cross-attention", "--force-fp32"]
    # --force-fp32 against training_dtype bf16: the node wins, and the run log says so once.
    [note] = [e["message"] for e in events if e["type"] == "note"]
    assert "--force-fp32 but training_dtype is bf16: training computes in bf16" in note
    assert [e["step"] for e in events if e["type"] == "step"] == [1, 2]
    assert any(e["type"] == "finished" for e in events)


@pytest.mark.slow
def test_a_server_launched_with_flash_attention_on_cpu_falls_back_once(comfy_root, fixture_paths, tmp_path, monkeypatch):
    site = _flash_standin(tmp_path / "site")  # ComfyUI exits at start with this flag unless flash_attn imports
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    run_dir, events, server_log = _train_on_server(comfy_root, tmp_path, ("--use-flash-attention",), "fp32")
    assert RunSpec.load(run_dir / "spec.json").launch.attention == "flash"
    [effective] = [e for e in events if e["type"] == "comfy_args"]
    assert effective["attention"] == "attention_pytorch" and effective["args"]["use_flash_attention"] is False
    [note] = [e["message"] for e in events if e["type"] == "note"]
    assert "flash-attn was requested" in note and "trains on the CPU" in note and "uses PyTorch SDPA instead" in note
    rank_log = (run_dir / "logs" / "rank0.log").read_text(errors="replace")
    assert rank_log.count("flash-attn was requested") == 1
    assert "Flash Attention failed" not in rank_log  # training never went through ComfyUI's flash op
    assert server_log.count("flash-attn was requested") == 1  # and ComfyUI's console shows the note
    assert any(e["type"] == "finished" for e in events)

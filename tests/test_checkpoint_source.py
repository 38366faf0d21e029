"""All-in-one checkpoints as a training source: 'Load Checkpoint (PipeTrainer)' and the stock loader's MODEL.

Fast tier: the training process's replay of the checkpoint loader builds the same diffusion model as
ComfyUI's stock checkpoint loader (bit-equal weights), an fp8 checkpoint stays fp8, the node's MODEL
carries a recipe and its CLIP and VAE work, the stock loader's MODEL is recognised where ComfyUI
records how it was built (>= 0.23) and otherwise gets a message naming the loader to use.
Slow tier: a graph with the checkpoint loader trains end to end through the server and samples with
the trained MODEL in the same graph, text and latents cached with the checkpoint's own CLIP and VAE.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from pipetrainer.devkit import quant_fixtures
from pipetrainer.devkit.host import history_error, output_images
from pipetrainer.training.model.model_source import CHECKPOINT_PREFIX, load_model
from pipetrainer.training.spec.options import ModelRecipe
from safetensors.torch import load_file

CHECKPOINT = "pipetrainer-tiny-sd3-checkpoint.safetensors"


@pytest.fixture(scope="session")
def checkpoint(comfy_root, fixture_paths):
    """The tiny SD3-family checkpoint in models/checkpoints (built once, atomically)."""
    path = comfy_root / "models" / "checkpoints" / CHECKPOINT
    if not path.exists():
        tmp = path.with_name(f".{path.name}.building")
        quant_fixtures.build_tiny_sd3_checkpoint(tmp, fixture_paths.clip, fixture_paths.vae)
        tmp.replace(path)
    return path


@pytest.fixture(scope="module")
def model_only_checkpoints(fixture_paths, tmp_path_factory):
    """The tiny MMDiT as a model-only checkpoint, in fp32 and in fp8 (Linear weights)."""
    folder = tmp_path_factory.mktemp("ckpt")
    fp8 = quant_fixtures.write_fp8(fixture_paths.mmdit, folder / "mmdit-fp8.safetensors")
    out = {}
    for name, source in (("fp32", fixture_paths.mmdit), ("fp8", fp8)):
        out[name] = quant_fixtures.write_checkpoint(load_file(str(source)), {}, {}, folder / f"ckpt-{name}.safetensors")
    return out


def _weights(patcher) -> dict[str, torch.Tensor]:
    return {k: v for k, v in patcher.model.diffusion_model.state_dict().items()}


def test_replayed_checkpoint_is_the_stock_loaders_model(model_only_checkpoints):
    import comfy.sd

    checkpoint = model_only_checkpoints["fp32"]
    stock = comfy.sd.load_checkpoint_guess_config(str(checkpoint), output_vae=False, output_clip=False,
                                                  model_options={"dtype": torch.float32})[0]
    ours = load_model(ModelRecipe("checkpoint", str(checkpoint)), "fp32")
    assert type(ours.model) is type(stock.model)
    expected, got = _weights(stock), _weights(ours)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    file = load_file(str(checkpoint))
    assert torch.equal(got["context_embedder.weight"], file[CHECKPOINT_PREFIX + "context_embedder.weight"])


def test_fp8_checkpoint_stays_fp8_in_training(model_only_checkpoints):
    patcher = load_model(ModelRecipe("checkpoint", str(model_only_checkpoints["fp8"])), "bf16")
    dm = patcher.model.diffusion_model
    linears = [m for m in dm.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 44 and {m.weight.dtype for m in linears} == {torch.float8_e4m3fn}  # every Linear
    file = load_file(str(model_only_checkpoints["fp8"]))
    key = "joint_blocks.1.x_block.mlp.fc1.weight"
    assert torch.equal(dm.get_submodule(key[: -len(".weight")]).weight.view(torch.uint8),
                       file[CHECKPOINT_PREFIX + key].view(torch.uint8))
    # the same checkpoint in fp32: "default" weights take the compute dtype, as for diffusion-model files
    plain = load_model(ModelRecipe("checkpoint", str(model_only_checkpoints["fp32"])), "bf16")
    assert {m.weight.dtype for m in plain.model.diffusion_model.modules() if isinstance(m, torch.nn.Linear)} \
        == {torch.bfloat16}


@pytest.mark.slow  # loads the 250 MB CLIP-L inside the checkpoint
def test_checkpoint_node_outputs_a_replayable_model_and_working_clip_and_vae(checkpoint):
    from pipetrainer.nodes.checkpoint_source import PipeTrainerLoadCheckpoint
    from pipetrainer.nodes.model_source import recipe_of

    model, clip, vae = PipeTrainerLoadCheckpoint.execute(CHECKPOINT, "default").result
    recipe = recipe_of(model)
    assert recipe.loader == "checkpoint" and recipe.path == str(checkpoint) and recipe.fingerprint
    assert recipe_of(model.clone()) == recipe  # survives the clones stock nodes make
    cond, pooled = clip.encode_from_tokens(clip.tokenize("a red circle"), return_pooled=True)
    assert cond.shape[-1] == 4096 and pooled.shape[-1] == 2048  # SD3's text encoder layout
    latent = vae.encode(torch.rand(1, 64, 64, 3))
    assert latent.shape[1] == 16


def test_stock_checkpoint_model_is_recognised_or_named(model_only_checkpoints):
    """ComfyUI >= 0.23 records how its checkpoint loader built a MODEL: training replays it. On older
    ComfyUI nothing says which file it came from: the message names the loader to use instead."""
    import comfy.sd
    from pipetrainer.nodes.model_source import no_recipe_message, recipe_of

    checkpoint = model_only_checkpoints["fp32"]
    model = comfy.sd.load_checkpoint_guess_config(str(checkpoint), output_vae=False, output_clip=False)[0]
    recipe = recipe_of(model)
    if getattr(model, "cached_patcher_init", None) is not None:
        assert recipe is not None and recipe.loader == "checkpoint" and recipe.path == str(checkpoint)
        assert recipe.weight_dtype == "default"
    else:
        assert recipe is None
        assert "'Load Checkpoint (PipeTrainer)'" in no_recipe_message(model)


def _graph(name: str, steps: int) -> dict:
    """The example workflow's shape with the checkpoint loader: its CLIP and VAE cache and sample."""
    return {
        "1": {"class_type": "PipeTrainerLoadCheckpoint", "inputs": {"ckpt_name": CHECKPOINT, "weight_dtype": "default"}},
        "4": {"class_type": "PipeTrainerDataset", "inputs": {"folder": "pipetrainer_demo", "resolution": 64,
                                                            "repeats": 1, "missing_caption": "error"}},
        "5": {"class_type": "PipeTrainerCache", "inputs": {"dataset": ["4", 0], "vae": ["1", 2], "clip": ["1", 1]}},
        "6": {"class_type": "PipeTrainerLoRA", "inputs": {"rank": 8, "alpha": 8.0, "dropout": 0.0,
                                                         "targets": "attention_mlp"}},
        "7": {"class_type": "PipeTrainerOptimizer", "inputs": {"optimizer": "AdamW", "learning_rate": 0.001,
                                                              "weight_decay": 0.0, "warmup_steps": 0,
                                                              "schedule": "constant"}},
        "8": {"class_type": "PipeTrainerTrain", "inputs": {
            "model": ["1", 0], "cache": ["5", 0], "lora": ["6", 0], "optimizer": ["7", 0], "lora_name": name,
            "steps": steps, "batch_size": 1, "gradient_accumulation": 1, "seed": 0, "save_every": 0,
            "training_dtype": "fp32", "gradient_checkpointing": True, "pipeline_stages": 1,
            "partition_method": "parameters", "resume": False}},
        "9": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red circle on a blue background", "clip": ["1", 1]}},
        "10": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "11": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "12": {"class_type": "KSampler", "inputs": {"model": ["8", 0], "positive": ["9", 0], "negative": ["10", 0],
                                                   "latent_image": ["11", 0], "seed": 42, "steps": 4, "cfg": 1.0,
                                                   "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "13": {"class_type": "VAEDecode", "inputs": {"samples": ["12", 0], "vae": ["1", 2]}},
        "14": {"class_type": "SaveImage", "inputs": {"images": ["13", 0], "filename_prefix": name}},
        # the untrained checkpoint MODEL, same seed: the trained LoRA must change the image
        "15": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["9", 0], "negative": ["10", 0],
                                                   "latent_image": ["11", 0], "seed": 42, "steps": 4, "cfg": 1.0,
                                                   "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "16": {"class_type": "VAEDecode", "inputs": {"samples": ["15", 0], "vae": ["1", 2]}},
        "17": {"class_type": "SaveImage", "inputs": {"images": ["16", 0], "filename_prefix": name + "_base"}},
    }


@pytest.mark.slow
def test_checkpoint_graph_trains_and_samples_in_the_same_graph(checkpoint, server, comfy_root):
    import comfy.lora
    from PIL import Image

    name = f"ckpt_{uuid.uuid4().hex[:6]}"
    entry = server.wait(server.queue(_graph(name, steps=8)), timeout=600)
    assert history_error(entry) is None, server.log_tail()
    lora_path = comfy_root / "models" / "loras" / f"{name}.safetensors"
    tensors = load_file(str(lora_path))
    assert tensors and all(k.startswith("diffusion_model.") for k in tensors)
    stock = load_model(ModelRecipe("checkpoint", str(checkpoint)), "fp32")
    key_map = comfy.lora.model_lora_keys_unet(stock.model, {})
    assert {k.rsplit(".", 2)[0] for k in tensors if k.endswith(".lora_A.weight")} <= key_map.keys()
    log = server.log_path.read_text(errors="replace")
    assert "lora key not loaded" not in log
    images = output_images(entry, comfy_root)
    assert len(images) == 2
    trained, base = (np.asarray(Image.open(p).convert("RGB"), dtype=np.int16) for p in sorted(images))
    assert np.abs(trained - base).max() > 0

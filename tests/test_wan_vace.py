"""Wan 2.1 VACE: the control stream as ComfyUI builds it, and what is refused.

The oracles are ComfyUI's own code: the ``WanVaceToVideo`` node with a real (narrow) Wan 2.1 VAE, then
``WAN21_Vace.extra_conds`` and ``apply_model`` of a WAN21_Vace model built from ComfyUI's config class.
The generic checks (staged forward, LoRA gradients, key map, stage split) are the row of
tests/test_families.py (tests/family_rows/wan_vace.py).
"""

from __future__ import annotations

import pytest
import torch
from pipetrainer.tests.family_rows.wan_vace import wan_vace_small
from pipetrainer.training.pipelines.base import Batch, adapter_for, family_name_for

LENGTH, HEIGHT, WIDTH = 5, 32, 48  # 2 latent frames of 4 x 6


def _staged(adapter, dm, batch):
    out = adapter.first_stage_inputs(batch)
    for layer in adapter.stage_layers(dm):
        out = layer(out)
    return out


def _clip(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.rand(LENGTH, HEIGHT, WIDTH, 3, generator=g)
    mask = (torch.rand(LENGTH, HEIGHT, WIDTH, generator=g) > 0.5).float()
    return pixels, mask


@pytest.mark.parametrize("with_mask", [True, False])
def test_cached_vace_context_is_what_wanvacetovideo_gives_the_model(comfy_root, with_mask):
    """The cache's vace_context of a control clip (and mask) = WanVaceToVideo + WAN21_Vace.extra_conds of the
    same clip, and the trainer's forward with it = ComfyUI's apply_model with the node's conditioning."""
    from comfy_extras.nodes_wan import WanVaceToVideo
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.training.cache.vace_control import VACE_CONTEXT, vace_context

    model = wan_vace_small().model
    assert family_name_for(model) == "WanVace"
    vae = tiny_wan21_vae()
    pixels, mask = _clip(3)
    mask = mask if with_mask else None
    cond = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(4))
    node = WanVaceToVideo.execute([[cond, {}]], [[cond, {}]], vae, WIDTH, HEIGHT, LENGTH, 1, 1.0,
                                  control_video=pixels, control_masks=mask)
    positive, _, latent, trim = node.result if hasattr(node, "result") else node
    values = positive[0][1]
    noise = torch.randn(latent["samples"].shape, generator=torch.Generator().manual_seed(5))
    theirs = model.extra_conds(noise=noise, device=torch.device("cpu"), cross_attn=cond,
                               vace_frames=values["vace_frames"], vace_mask=values["vace_mask"])

    cached = vace_context(vae, pixels, mask)  # one control stream, as the cache stores it
    assert trim == 0 and cached.shape == (1, 96, 2, HEIGHT // 8, WIDTH // 8)
    assert torch.equal(cached[None], theirs["vace_context"].cond)
    assert theirs["vace_strength"].cond == [1.0]

    adapter = adapter_for("WanVace")
    sigma = torch.tensor([0.6])
    t = model.model_sampling.timestep(sigma)
    batch = Batch(noise, t, cond, extras={VACE_CONTEXT: cached[None]})
    with torch.no_grad():
        ours = _staged(adapter, model.diffusion_model, batch)
        without = _staged(adapter, model.diffusion_model, Batch(noise, t, cond, extras={VACE_CONTEXT: 0 * cached[None]}))
        comfy = model.apply_model(noise, sigma, c_crossattn=cond, vace_context=theirs["vace_context"].cond,
                                  vace_strength=theirs["vace_strength"].cond)
    denoised = model.model_sampling.calculate_denoised(sigma, ours.float(), noise)
    assert torch.allclose(denoised, comfy, rtol=0, atol=1e-6 * comfy.abs().max().item())
    assert (ours - without).abs().max() > 1e-3  # the control stream really steers the prediction


def test_control_clips_the_node_cannot_fold_are_refused_with_the_fix():
    from pipetrainer.training.cache.vace_control import control_problems

    pixels, mask = _clip(6)
    assert control_problems(pixels, mask) == []
    [odd] = control_problems(pixels[:, :, :44], None)
    assert "multiples of 8" in odd and "44x32" in odd
    [short] = control_problems(pixels, mask[:3])
    assert "one mask frame per clip frame" in short


def test_two_control_streams_each_add_their_hint(comfy_root):
    """Chained WanVaceToVideo nodes give N control streams ([B, N, 96, F, H, W]); each is its own VACE stream."""
    model = wan_vace_small().model
    g = torch.Generator().manual_seed(8)
    noise = torch.randn(2, 16, 2, 4, 6, generator=g)
    vace = torch.randn(2, 2, 96, 2, 4, 6, generator=g)
    cond = torch.randn(2, 5, 16, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        ours = _staged(adapter_for("WanVace"), model.diffusion_model,
                       Batch(noise, model.model_sampling.timestep(sigma), cond, extras={"vace_context": vace}))
        comfy = model.apply_model(noise, sigma, c_crossattn=cond, vace_context=vace, vace_strength=[1.0, 1.0])
    denoised = model.model_sampling.calculate_denoised(sigma.view(-1, 1, 1, 1, 1), ours.float(), noise)
    assert torch.allclose(denoised, comfy, rtol=0, atol=1e-6 * comfy.abs().max().item())


def test_a_vace_mapping_comfyui_cannot_run_is_refused():
    """5 main blocks for 2 VACE blocks: ComfyUI's mapping (every 2nd block) asks for a third VACE block."""
    import torch.nn as nn
    from comfy.ldm.wan.model import VaceWanModel

    dm = VaceWanModel(patch_size=(1, 2, 2), in_dim=16, dim=64, ffn_dim=128, freq_dim=256, text_dim=16, out_dim=16,
                      num_heads=2, num_layers=5, vace_layers=2, vace_in_dim=96, device="meta", operations=nn)
    [problem] = adapter_for("WanVace").support_problems(dm)
    assert "VACE blocks [0, 1, 2]" in problem
    with pytest.raises(NotImplementedError, match="ComfyUI cannot run it either"):
        adapter_for("WanVace").stage_layers(dm)
    assert "Wan VACE models are not supported" in adapter_for("Wan").support_problems(dm)[0]


def test_a_cache_without_control_conditioning_is_refused_before_training(comfy_root):
    """Until the Cache node builds vace_context, preflight names what is missing and why, never trains without it."""
    from pipetrainer.training.pipelines.checks import CachedShapes, ModelInputs, cache_vs_model_problems
    from pipetrainer.training.pipelines.wan import WanOptions

    dm = wan_vace_small().model.diffusion_model
    adapter = adapter_for("WanVace")
    inputs = ModelInputs("WanVace", 16, adapter.geometry(dm), 16, 0, dict(adapter.extras(dm)))

    def cached(extras):
        return CachedShapes(latents={"l0": (16, 3, 8, 8)}, conds={"t0": (5, 16)}, pooled={"t0": 0}, unreadable=(),
                            extras=extras, items=(("clip.mp4", "l0", "t0"),))

    [missing] = cache_vs_model_problems(cached({}), inputs)
    assert "'vace_context'" in missing and "clip.mp4" in missing and "WanVaceToVideo" in missing
    assert cache_vs_model_problems(cached({"l0": {"vace_context": (1, 96, 3, 8, 8)}}), inputs) == []
    [wrong] = cache_vs_model_problems(cached({"l0": {"vace_context": (1, 96, 2, 8, 8)}}), inputs)
    assert "does not fit" in wrong

    x = torch.zeros(1, 16, 3, 6, 8)
    with pytest.raises(ValueError, match="vace_context"):
        adapter.first_stage_inputs(Batch(x, torch.ones(1), torch.zeros(1, 5, 16)))
    with pytest.raises(ValueError, match="leave first_frame_clean off"):
        adapter.first_stage_inputs(Batch(x, torch.ones(1), torch.zeros(1, 5, 16), clean=x,
                                         extras={"vace_context": torch.zeros(1, 1, 96, 3, 6, 8)},
                                         options=WanOptions(first_frame_clean=True)))


def _write_video(path, frames: int, fps: int, size: tuple[int, int], seed: int) -> None:
    import av
    import numpy as np

    w, h = size
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h, w, 3))
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            img = ((base + 29 * i) % 256).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def test_control_files_are_read_like_their_clip_and_encoded_by_the_node(comfy_root, tmp_path):
    """A control clip and a mask clip of an item: its bucket, frame rate and frame count, then WanVaceToVideo."""
    from comfy_extras.nodes_wan import WanVaceToVideo
    from PIL import Image
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.training.cache.buckets import Bucket
    from pipetrainer.training.cache.media import load_video
    from pipetrainer.training.cache.vace_control import control_extras
    from pipetrainer.training.data.dataset_controls import ControlSet

    vae = tiny_wan21_vae()
    bucket = Bucket(WIDTH, HEIGHT, LENGTH)
    control, mask = tmp_path / "clip.mp4", tmp_path / "clip_mask.mp4"
    _write_video(control, 12, 24, (64, 40), seed=1)  # another size and frame rate than the bucket's
    _write_video(mask, 12, 24, (64, 40), seed=2)
    got = control_extras(vae, ControlSet(((str(control), str(mask)),)), bucket, 16.0)["vace_context"]

    pixels = load_video(str(control), bucket, 16.0)
    gray = load_video(str(mask), bucket, 16.0).mean(dim=-1)
    assert pixels.shape == (LENGTH, HEIGHT, WIDTH, 3) and gray.shape == (LENGTH, HEIGHT, WIDTH)
    node = WanVaceToVideo.execute([[torch.zeros(1, 1, 1), {}]], [], vae, WIDTH, HEIGHT, LENGTH, 1, 1.0,
                                  control_video=pixels, control_masks=gray)
    values = (node.result if hasattr(node, "result") else node)[0][0][1]
    model = wan_vace_small().model
    theirs = model.extra_conds(noise=torch.zeros(1, 16, 2, 4, 6), device=torch.device("cpu"),
                               vace_frames=values["vace_frames"], vace_mask=values["vace_mask"])["vace_context"].cond
    assert torch.equal(got[None], theirs)
    assert not torch.equal(got, control_extras(vae, ControlSet(((str(control), None),)), bucket, 16.0)["vace_context"])  # the mask counts

    with pytest.raises(ValueError, match="at least as long as the training clip"):
        control_extras(vae, ControlSet(((str(control), None),)), Bucket(WIDTH, HEIGHT, 9), 8.0)  # 12 frames at 24 fps: 4 at 8 fps
    still = tmp_path / "still.png"
    Image.new("RGB", (64, 40), (200, 10, 10)).save(still)
    with pytest.raises(ValueError, match="is an image, and its training clip has 5 frames"):
        control_extras(vae, ControlSet(((str(still), None),)), bucket, 16.0)
    one = control_extras(vae, ControlSet(((str(still), str(still)),)), Bucket(WIDTH, HEIGHT, 1), 16.0)["vace_context"]
    assert one.shape == (1, 96, 1, HEIGHT // 8, WIDTH // 8)

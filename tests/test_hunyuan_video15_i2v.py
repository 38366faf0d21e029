"""HunyuanVideo 1.5 image-to-video from the Cache node's ``start_image = first_frame_alone``.

The oracle is ComfyUI's own inference graph for HunyuanVideo 1.5 I2V: ``CLIP Vision Encode`` (crop center, as
ComfyUI's 1.5 I2V template sets it) and ``HunyuanVideo15ImageToVideo`` given the item's first frame, then
``HunyuanVideo15.extra_conds`` (``concat_cond`` and ``clip_fea``) and ``apply_model`` of a tiny 1.5 model built
from ComfyUI's own config class (tests/family_rows/hunyuan_video15.py: 65 input channels, as every 1.5 release,
text-to-video and image-to-video alike, and an 8-wide vision projection). The VAE is ComfyUI's lighttae_hv15
layout (``comfy.taesd.taehv.TAEHV``, 32 latent channels, what ``comfy.sd.VAE`` detects from its keys) with seeded
weights, in memory; the CLIP vision model is ComfyUI's ``ClipVisionModel`` of a SigLIP config shrunk to width 8
(SigLIP so400m's stock config is 400 M parameters).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pipetrainer.tests.family_rows.common import require_model_class
from pipetrainer.tests.family_rows.hunyuan_video15 import CONTEXT, hunyuan_video15_small
from pipetrainer.tests.test_i2v_cache import IMAGE_BUCKET, SETTINGS, VIDEO_BUCKET, _by_source, _write_video
from pipetrainer.training.cache.start_image import (
    CLIP_FEA,
    CLIP_VISION_LAST,
    CONCAT_LATENT,
    CONCAT_LATENT_ALONE,
    StartImage,
)
from pipetrainer.training.pipelines.base import Batch, adapter_for

SIGLIP_CONFIG = {  # ComfyUI's clip_vision_siglip_384.json layout, shrunk to the tiny model's vision_in width 8
    "num_channels": 3, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 8, "image_size": 28, "intermediate_size": 16,
    "model_type": "siglip_vision_model", "num_attention_heads": 2, "num_hidden_layers": 2, "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}


def tiny_siglip(folder: Path, seed: int):
    """ComfyUI's ``ClipVisionModel`` (what 'Load CLIP Vision' returns for sigclip_vision_patch14_384) at width 8."""
    import comfy.clip_vision
    from pipetrainer.devkit.fixtures import _randomize_scaled

    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "siglip_tiny.json"
    config.write_text(json.dumps(SIGLIP_CONFIG), encoding="utf-8")
    model = comfy.clip_vision.ClipVisionModel(str(config))
    state = _randomize_scaled({k: v.float() for k, v in model.get_sd().items()}, seed)
    missing, unexpected = model.load_sd(state)
    assert not missing and not unexpected
    return model


def tiny_hv15_vae(seed: int = 1505):
    """A lighttae_hv15-layout VAE (``TAEHV``, 32 latent channels, 16x spatial and 4x temporal) as a ComfyUI ``VAE``,
    with seeded weights: ComfyUI's VAE detection reads the layout from the keys (``decoder.22.bias``)."""
    import comfy.latent_formats
    import comfy.sd
    from comfy.taesd.taehv import TAEHV
    from pipetrainer.devkit.fixtures import _randomize_scaled

    model = TAEHV(latent_channels=32, latent_format=comfy.latent_formats.HunyuanVideo15)
    vae = comfy.sd.VAE(sd=_randomize_scaled({k: v.float() for k, v in model.state_dict().items()}, seed))
    assert vae.latent_channels == 32
    return vae


class _PoolVAE:
    """ComfyUI 0.3.75 only: a stand-in for the VAE both the cache's start image and ``HunyuanVideo15ImageToVideo``
    call, as a fixed function (16 x 16 x 4k+1 average pooling, a seeded projection to 32 channels). 0.3.75 cannot
    encode with lighttae_hv15 (its ``VAE`` refuses, and its ``TAEHV`` lacks the 2 x 2 patchify of 32 channels)."""

    def __init__(self, seed: int = 1506):
        self.weight = torch.randn(32, 3, generator=torch.Generator().manual_seed(seed))

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels[..., :3].movedim(-1, 0)[None]  # [1, 3, F, H, W]
        first = torch.nn.functional.avg_pool3d(x[:, :, :1], (1, 16, 16))
        rest = torch.nn.functional.avg_pool3d(x[:, :, 1:], (4, 16, 16)) if x.shape[2] > 1 else first[:, :, :0]
        return torch.einsum("oc,bcfhw->bofhw", self.weight, torch.cat((first, rest), dim=2))


@pytest.fixture(scope="module")
def hv15_vae(comfy_root):
    """The lighttae_hv15-layout VAE where this ComfyUI encodes with it (current), else None (0.3.75)."""
    require_model_class("HunyuanVideo15")
    vae = tiny_hv15_vae()
    try:
        vae.encode(torch.zeros(1, 16, 16, 3))
    except (NotImplementedError, RuntimeError):
        return None
    return vae


@pytest.fixture(scope="module")
def siglip(comfy_root, tmp_path_factory):
    return tiny_siglip(tmp_path_factory.mktemp("siglip"), seed=43)


@pytest.fixture(scope="module")
def hv15_i2v(encoders, hv15_vae, siglip, tmp_path_factory):
    """One 5-frame clip and one image cached with start_image none, then first_frame_alone with a tiny SigLIP."""
    if hv15_vae is None:
        pytest.skip("ComfyUI 0.3.75 cannot encode with lighttae_hv15 (its VAE refuses it) and detection pins the "
                    "full HunyuanVideo 1.5 VAE's 1024-wide blocks: no tiny 32-channel VAE to cache with "
                    "(HunyuanVideo15ImageToVideo and HunyuanVideo15's conditioning are the same there)")
    from PIL import Image
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import scan_dataset

    root = tmp_path_factory.mktemp("hv15_i2v")
    data = root / "data"
    data.mkdir()
    _write_video(data / "clip.mp4", frames=24, fps=24, size=(VIDEO_BUCKET.width, VIDEO_BUCKET.height))
    (data / "clip.txt").write_text("a drifting gradient", encoding="utf-8")
    g = torch.Generator().manual_seed(33)
    still = (torch.rand(IMAGE_BUCKET.height, IMAGE_BUCKET.width, 3, generator=g) * 255).to(torch.uint8)
    Image.fromarray(still.numpy()).save(data / "still.png")
    (data / "still.txt").write_text("a noisy still", encoding="utf-8")
    vae, clip = hv15_vae, encoders[1]

    def run(start: StartImage):
        return build_cache(scan_dataset(data, 32, buckets=SETTINGS), vae, clip, root / "cache", start_image=start)

    results = {"none": run(StartImage()), "alone": run(StartImage("first_frame_alone", siglip))}
    return {"results": results, "data": data, "vae": vae, "siglip": siglip}


def _first_frames(data: Path) -> dict[str, torch.Tensor]:
    from pipetrainer.training.cache.media import load_image, load_video

    return {"clip.mp4": load_video(str(data / "clip.mp4"), VIDEO_BUCKET, SETTINGS.fps),
            "still.png": load_image(str(data / "still.png"), IMAGE_BUCKET)}


def _comfy_i2v(vae, siglip, first: torch.Tensor, frames: int) -> dict:
    """What ComfyUI's HunyuanVideo 1.5 I2V graph attaches to the positive conditioning for start image ``first``."""
    from comfy_extras.nodes_hunyuan import HunyuanVideo15ImageToVideo

    import nodes

    height, width = first.shape[1:3]
    clip_output = nodes.CLIPVisionEncode().encode(siglip, first, "center")[0]
    cond = torch.zeros(1, 3, CONTEXT)
    out = HunyuanVideo15ImageToVideo.execute([[cond, {}]], [[cond, {}]], vae, width, height, frames, 1,
                                             start_image=first, clip_vision_output=clip_output)
    positive, _, latent = out.result if hasattr(out, "result") else out
    return {**positive[0][1], "samples": latent["samples"]}


def test_cached_extras_equal_what_hunyuanvideo15imagetovideo_and_clip_vision_encode_build(hv15_i2v):
    """For a 5-frame clip and a 1-frame image: the cached start latent is ``concat_latent_image`` (the start image
    encoded alone, zeros after) and the cached SigLIP states are ``clip_vision_output.last_hidden_state``."""
    cached = _by_source(hv15_i2v["results"]["alone"])
    assert cached["clip.mp4"][0].bucket == VIDEO_BUCKET.name and cached["still.png"][0].bucket == IMAGE_BUCKET.name
    for name, pixels in _first_frames(hv15_i2v["data"]).items():
        example = cached[name][1]
        theirs = _comfy_i2v(hv15_i2v["vae"], hv15_i2v["siglip"], pixels[:1], pixels.shape[0])
        assert set(example.extras) == {CONCAT_LATENT_ALONE, CLIP_VISION_LAST}, name
        raw = example.extras[CONCAT_LATENT_ALONE]
        image = theirs["concat_latent_image"]
        assert raw.shape == example.latent.shape == image.shape[1:] == theirs["samples"].shape[1:], name
        assert torch.allclose(raw, image[0], atol=1e-5 * image.abs().max().item(), rtol=0), name
        assert raw[:, :1].abs().max() > 0 and torch.equal(raw[:, 1:], torch.zeros_like(raw[:, 1:])), name
        mask = theirs["concat_mask"]  # 0 on the start image's one latent frame, 1 after
        assert mask[0, 0, 0].eq(0).all() and mask[0, 0, 1:].eq(1).all(), name
        states = theirs["clip_vision_output"].last_hidden_state
        fea = example.extras[CLIP_VISION_LAST]
        assert fea.shape == states.shape[1:] == (4, SIGLIP_CONFIG["hidden_size"]), name
        assert torch.allclose(fea, states[0].float(), atol=1e-6 * states.abs().max().item(), rtol=0), name
        penultimate = theirs["clip_vision_output"].penultimate_hidden_states[0]
        assert not torch.allclose(fea, penultimate.float(), atol=1e-3), name  # not Wan's penultimate states


def test_the_mode_is_keyed_and_says_what_changed(hv15_i2v):
    alone = hv15_i2v["results"]["alone"]
    assert alone.report.reencoded_kinds == {"latent": 2} and alone.report.reused == {"text": 2}
    assert sorted(alone.report.reencoded) == [
        "clip.mp4 latent: start-image conditioning changed (none -> first_frame_alone)",
        "still.png latent: start-image conditioning changed (none -> first_frame_alone)"]
    assert StartImage("first_frame_alone").identity() == {"mode": "first_frame_alone", "clip_vision": None}
    assert StartImage("first_frame_alone", hv15_i2v["siglip"]).identity()["clip_vision"]["crop"] == "center"


@pytest.mark.parametrize("with_vision", [True, False], ids=["siglip", "no_clip_vision"])
def test_staged_forward_equals_comfyui_apply_model_after_hunyuanvideo15imagetovideo(hv15_vae, siglip, with_vision):
    """The adapter's stages on a 5-frame clip's start-image extras, as the cache makes them (``StartImage.encode``;
    ByT5 states, guidance), give ComfyUI's ``apply_model`` with the conditioning ``HunyuanVideo15ImageToVideo``
    and ``CLIP Vision Encode`` produce, through ``extra_conds``."""
    from pipetrainer.training.pipelines.hunyuan_image import BYT5
    from pipetrainer.training.pipelines.hunyuan_video import HunyuanVideoOptions

    model = hunyuan_video15_small(True, 1, 1, seed=61).model
    adapter = adapter_for("HunyuanVideo15")
    specs = adapter.extras(model.diffusion_model)
    assert specs[CONCAT_LATENT_ALONE].is_latent and not specs[CONCAT_LATENT_ALONE].required
    assert specs[CLIP_VISION_LAST].shape == ("*", 8) and not specs[CLIP_VISION_LAST].required
    vae = hv15_vae or _PoolVAE()
    pixels = torch.rand(5, 16, 48, 3, generator=torch.Generator().manual_seed(60))
    made = StartImage("first_frame_alone", siglip).encode(pixels, vae.encode(pixels)[0], lambda p: vae.encode(p)[0])
    theirs = _comfy_i2v(vae, siglip, pixels[:1], pixels.shape[0])
    g = torch.Generator().manual_seed(62)
    x = torch.randn(theirs["samples"].shape, generator=g)
    cond, byt5 = torch.randn(1, 6, CONTEXT, generator=g), torch.randn(1, 3, 1472, generator=g)
    sigma = torch.tensor([0.6])
    vision = {"clip_vision_output": theirs["clip_vision_output"]} if with_vision else {}
    conds = model.extra_conds(noise=x, device=torch.device("cpu"), cross_attn=cond, conditioning_byt5small=byt5,
                              pooled_output=None,  # Qwen2.5-VL gives none; 1.5 takes no pooled vector
                              guidance=3.5, concat_latent_image=theirs["concat_latent_image"],
                              concat_mask=theirs["concat_mask"], **vision)
    assert ("clip_fea" in conds) == with_vision
    extras = {CONCAT_LATENT_ALONE: model.process_latent_in(made[CONCAT_LATENT_ALONE][None]), BYT5: byt5}
    if with_vision:
        extras[CLIP_VISION_LAST] = made[CLIP_VISION_LAST][None]
    t = model.model_sampling.timestep(sigma).float()
    out = adapter.first_stage_inputs(Batch(model.model_sampling.calculate_input(sigma, x), t, cond, None,
                                           extras=extras, options=HunyuanVideoOptions(guidance=3.5)))
    assert len(out) == (7 if with_vision else 6)
    c_concat = conds["c_concat"].cond
    assert torch.allclose(out[0][:, 32:], c_concat, rtol=0, atol=1e-6 * c_concat.abs().max().item())
    assert out[0][0, 64, 0].eq(1).all() and out[0][0, 64, 1:].eq(0).all()  # concat_cond's mask: 1 - concat_mask
    assert adapter.loss_mask(tuple(x.shape[1:]), HunyuanVideoOptions()) is None  # every frame is predicted
    with torch.no_grad():
        for layer in adapter.stage_layers(model.diffusion_model):
            out = layer(out)
        theirs_out = model.apply_model(x, sigma, **{k: v.cond for k, v in conds.items()})
    ours = model.model_sampling.calculate_denoised(sigma, out.float(), x)
    assert torch.allclose(ours, theirs_out, rtol=0, atol=1e-6 * theirs_out.abs().max().item())
    if with_vision:  # the vision states matter: without them the prediction differs
        del conds["clip_fea"]
        blind = model.apply_model(x, sigma, **{k: v.cond for k, v in conds.items()})
        assert not torch.allclose(blind, theirs_out, rtol=0, atol=1e-4 * theirs_out.abs().max().item())


def test_vision_tokens_join_the_text_mask_in_front(comfy_root):
    """With a text mask (which ComfyUI's forward cannot combine with vision states), SigLIP's tokens are kept."""
    model = hunyuan_video15_small(False, 2, 0, seed=63).model
    adapter = adapter_for("HunyuanVideo15")
    g = torch.Generator().manual_seed(64)
    x = torch.randn(1, 32, 2, 1, 3, generator=g)
    cond = torch.randn(1, 5, CONTEXT, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    extras = {CONCAT_LATENT_ALONE: torch.randn(1, 32, 2, 1, 3, generator=g),
              CLIP_VISION_LAST: torch.randn(1, 4, 8, generator=g), "attention_mask": mask}
    inputs = adapter.first_stage_inputs(Batch(x, torch.tensor([500.0]), cond, None, extras=extras))
    assert inputs[4].tolist() == [[1, 1, 1, 1, 1, 1, 1, 0, 0]]
    with torch.no_grad():
        img, txt, *_ = adapter.stage_layers(model.diffusion_model)[0](inputs)
    assert txt.shape[1] == 9


def test_a_wan_first_frame_cache_is_refused_naming_first_frame_alone(comfy_root):
    from pipetrainer.training.pipelines.checks import CachedShapes, extra_problems

    require_model_class("HunyuanVideo15")
    dm = hunyuan_video15_small(True, 1, 0, seed=8).model.diffusion_model
    specs = adapter_for("HunyuanVideo15").extras(dm)

    def shapes(extras):
        return CachedShapes(latents={"l0": (32, 3, 5, 7)}, conds={"t0": (6, CONTEXT)}, pooled={"t0": 0},
                            unreadable=(), extras={"l0": extras}, items=(("clip.mp4", "l0", "t0"),))

    wan = shapes({CONCAT_LATENT: (32, 3, 5, 7), CLIP_FEA: (257, 8)})
    [problem] = extra_problems(wan, specs, "HunyuanVideo15")
    assert "'concat_latent' for clip.mp4" in problem and "Wan's start image" in problem
    assert "set start_image to first_frame_alone" in problem
    assert extra_problems(shapes({CONCAT_LATENT_ALONE: (32, 3, 5, 7), CLIP_VISION_LAST: (729, 8)}), specs,
                          "HunyuanVideo15") == []
    assert extra_problems(shapes({CONCAT_LATENT_ALONE: (32, 3, 5, 7)}), specs, "HunyuanVideo15") == []
    assert extra_problems(shapes({}), specs, "HunyuanVideo15") == []  # text-to-video as before
    [wrong] = extra_problems(shapes({CONCAT_LATENT_ALONE: (32, 3, 5, 7), CLIP_VISION_LAST: (257, 1280)}), specs,
                             "HunyuanVideo15")
    assert "'clip_vision_last'" in wrong and "does not fit" in wrong


def test_only_the_start_latent_without_a_clip_vision_model():
    pixels, latent = torch.rand(1, 16, 48, 3), torch.randn(32, 1, 1, 3)
    out = StartImage("first_frame_alone").encode(pixels, latent, encode_latent=None)  # one frame: no second encode
    assert list(out) == [CONCAT_LATENT_ALONE] and torch.equal(out[CONCAT_LATENT_ALONE], latent)
    clip = torch.rand(5, 16, 48, 3)
    first = torch.randn(32, 1, 1, 3)
    calls = []

    def encode(p):
        calls.append(p.shape)
        return first

    out = StartImage("first_frame_alone").encode(clip, torch.randn(32, 2, 1, 3), encode_latent=encode)
    assert calls == [(1, 16, 48, 3)]  # the start image alone
    assert torch.equal(out[CONCAT_LATENT_ALONE][:, :1], first) and out[CONCAT_LATENT_ALONE][:, 1:].eq(0).all()


def test_a_wan_i2v_model_refuses_a_first_frame_alone_cache(comfy_root):
    from pipetrainer.tests.test_i2v_cache import _wan_inputs
    from pipetrainer.training.pipelines.checks import CachedShapes, cache_vs_model_problems

    alone = CachedShapes(latents={"l0": (16, 2, 4, 8)}, conds={"t0": (7, 4096)}, pooled={"t0": 0}, unreadable=(),
                         extras={"l0": {CONCAT_LATENT_ALONE: (16, 2, 4, 8), CLIP_VISION_LAST: (4, 1280)}},
                         items=(("clip.mp4", "l0", "t0"),))
    missing, other = cache_vs_model_problems(alone, _wan_inputs("i2v", 36))
    assert "'concat_latent'" in missing and "set start_image to first_frame" in missing
    assert "'clip_vision_last'" in other and "another start_image mode" in other and "disconnect" not in other

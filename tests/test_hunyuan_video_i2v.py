"""HunyuanVideo image-to-video (``HunyuanVideoI2V``) from the Cache node's ``start_image = first_frame_alone``.

The oracle is ComfyUI's own HunyuanVideo I2V graph: ``CLIP Vision Encode`` (crop center) of the start image with a
llava CLIP vision model, ``TextEncodeHunyuanVideo_ImageToVideo`` (the caption with the image's ``mm_projected``
tokens, image_interleave 2) and ``HunyuanImageToVideo`` (guidance_type "v1 (concat)") given the item's first frame.
The cached text cond must be that node's cond, and the cached start latent that node's ``concat_latent_image``
(zero latent frames after it, as ``concat_cond`` pads it). The staged forward with these extras against
``apply_model`` is the family row's generic check (tests/family_rows/hunyuan_video.py, ``HunyuanVideoI2V``).

Tiny models in ComfyUI's own classes, seeded: HunyuanVideo's text encoder (``HunyuanVideoClipModel`` with the real
llama tokenizer; CLIP-L at width 8, llava-llama3 with 4 layers of one head over ComfyUI's fixed 4096 width, which
``LlavaProjector`` pins, and the real 128320-token vocabulary in bf16: 1 GB), and ``ClipVisionModel`` of a llava
config at width 8 (its projector's 4096 x 4096 layer: 17 M). The VAE is the narrow Wan 2.1 VAE (16 channels,
8x spatial, 4k+1 frames: HunyuanVideo's latent geometry).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from pipetrainer.tests.test_i2v_cache import IMAGE_BUCKET, SETTINGS, VIDEO_BUCKET, _by_source, _write_video
from pipetrainer.training.cache.start_image import CLIP_VISION_LAST, CONCAT_LATENT_ALONE, StartImage
from pipetrainer.training.cache.start_image_prompt import START_IMAGE_PROMPT

CLIP_L = {"attention_dropout": 0.0, "bos_token_id": 0, "dropout": 0.0, "eos_token_id": 49407, "hidden_act": "quick_gelu",
          "hidden_size": 8, "initializer_factor": 1.0, "initializer_range": 0.02, "intermediate_size": 16,
          "layer_norm_eps": 1e-05, "max_position_embeddings": 77, "model_type": "clip_text_model",
          "num_attention_heads": 1, "num_hidden_layers": 2, "pad_token_id": 1, "projection_dim": 8, "vocab_size": 49408}
LLAMA = {"hidden_size": 4096, "intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 1,
         "num_key_value_heads": 1}  # 4 layers: the encoder reads layer -3
LLAVA_VISION = {"hidden_act": "quick_gelu", "hidden_size": 8, "image_size": 28, "intermediate_size": 16,
                "layer_norm_eps": 1e-5, "model_type": "clip_vision_model", "num_attention_heads": 1, "num_channels": 3,
                "num_hidden_layers": 2, "patch_size": 14, "projection_dim": 8, "projector_type": "llava3"}
CAPTIONS = {"clip.mp4": "a drifting gradient", "still.png": "a noisy still"}


def _llama_tokenizer_or_skip() -> None:
    import comfy.text_encoders.hunyuan_video as hv

    path = Path(hv.__file__).parent / "llama_tokenizer" / "tokenizer.json"
    if not path.exists():
        pytest.skip(f"this ComfyUI host has no {path.relative_to(path.parents[3])} (its llama tokenizer), so "
                    "HunyuanVideo's text encoder cannot tokenize here; ComfyUI ships it")


def tiny_hunyuan_video_clip(seed: int):
    """A ``comfy.sd.CLIP`` of HunyuanVideo's text encoder (tokenizer and encode as ComfyUI's), tiny but for the
    llama width and vocabulary the image tokens need."""
    import comfy.sd
    import comfy.sd1_clip
    from comfy.text_encoders.hunyuan_video import HunyuanVideoClipModel, HunyuanVideoTokenizer, LLAMAModel
    from pipetrainer.tests.custom_nodes.pipetrainer_test_nodes.tiny_llm import seeded_llm_state, with_config

    class TinyHunyuanVideoClipModel(HunyuanVideoClipModel):
        def __init__(self, device="cpu", dtype=None, model_options={}):  # noqa: B006 - ComfyUI's signature
            torch.nn.Module.__init__(self)
            self.clip_l = comfy.sd1_clip.SDClipModel(device=device, dtype=dtype, return_projected_pooled=False,
                                                     textmodel_json_config=dict(CLIP_L), model_options=model_options)
            self.llama = with_config(LLAMAModel, LLAMA)(device=device, dtype=torch.bfloat16, model_options=model_options)
            self.dtypes = {dtype, torch.bfloat16}

    class Target:
        params: dict = {}
        clip = TinyHunyuanVideoClipModel
        tokenizer = HunyuanVideoTokenizer

    clip = comfy.sd.CLIP(target=Target, parameters=1_000_000)
    state = clip.cond_stage_model.state_dict()
    embed = "llama.transformer.model.embed_tokens.weight"
    seeded = seeded_llm_state({k: v for k, v in state.items() if k != embed}, seed, 1.0)
    rows, width = state[embed].shape  # 525 M values: windows of one seeded vector, each token its own
    seeded[embed] = torch.randn(rows + width, generator=torch.Generator().manual_seed(seed)).unfold(0, width, 1)[:rows]
    missing, unexpected = clip.load_sd(seeded, full_model=True)
    assert not missing and not unexpected
    return clip


def tiny_llava_vision(folder: Path, seed: int):
    """ComfyUI's ``ClipVisionModel`` of a llava config (what 'Load CLIP Vision' gives for llava_llama3_vision)."""
    import comfy.clip_vision
    from pipetrainer.devkit.fixtures import _randomize_scaled

    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "llava_vision_tiny.json"
    config.write_text(json.dumps(LLAVA_VISION), encoding="utf-8")
    model = comfy.clip_vision.ClipVisionModel(str(config))
    missing, unexpected = model.load_sd(_randomize_scaled({k: v.float() for k, v in model.get_sd().items()}, seed))
    assert not missing and not unexpected
    return model


@pytest.fixture(scope="module")
def hv_i2v(comfy_root, tmp_path_factory):
    """One 5-frame clip and one image cached with first_frame_alone, the llava CLIP vision model and HunyuanVideo's
    text encoder."""
    _llama_tokenizer_or_skip()
    from PIL import Image
    from pipetrainer.devkit.fixtures_video import tiny_wan21_vae
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import scan_dataset

    root = tmp_path_factory.mktemp("hv_i2v")
    data = root / "data"
    data.mkdir()
    _write_video(data / "clip.mp4", frames=24, fps=24, size=(VIDEO_BUCKET.width, VIDEO_BUCKET.height))
    g = torch.Generator().manual_seed(34)
    still = (torch.rand(IMAGE_BUCKET.height, IMAGE_BUCKET.width, 3, generator=g) * 255).to(torch.uint8)
    Image.fromarray(still.numpy()).save(data / "still.png")
    for name, caption in CAPTIONS.items():
        (data / name).with_suffix(".txt").write_text(caption, encoding="utf-8")
    vae, clip, vision = tiny_wan21_vae(), tiny_hunyuan_video_clip(seed=71), tiny_llava_vision(root / "llava", 72)

    def run(start: StartImage, cache: Path):
        return build_cache(scan_dataset(data, 32, buckets=SETTINGS), vae, clip, cache, start_image=start)

    result = run(StartImage("first_frame_alone", vision), root / "cache")
    return {"result": result, "data": data, "vae": vae, "clip": clip, "vision": vision, "run": run, "root": root}


def _first_frames(data: Path) -> dict[str, torch.Tensor]:
    from pipetrainer.training.cache.media import load_image, load_video

    return {"clip.mp4": load_video(str(data / "clip.mp4"), VIDEO_BUCKET, SETTINGS.fps),
            "still.png": load_image(str(data / "still.png"), IMAGE_BUCKET)}


def _comfy_graph(clip, vision, vae, first: torch.Tensor, frames: int, caption: str) -> dict:
    """What ComfyUI's HunyuanVideo I2V graph gives for start image ``first``: the prompt's cond and what
    HunyuanImageToVideo v1 attaches to it, with its empty latent."""
    from comfy_extras.nodes_hunyuan import HunyuanImageToVideo, TextEncodeHunyuanVideo_ImageToVideo

    import nodes

    output = nodes.CLIPVisionEncode().encode(vision, first, "center")[0]
    result = TextEncodeHunyuanVideo_ImageToVideo.execute(clip, output, caption, 2)
    positive = result.args[0] if hasattr(result, "args") else result[0]
    height, width = first.shape[1:3]
    result = HunyuanImageToVideo.execute(positive, vae, width, height, frames, 1, "v1 (concat)", start_image=first)
    positive, latent = result.args if hasattr(result, "args") else result
    return {"cond": positive[0][0], **positive[0][1], "samples": latent["samples"], "mm": output.mm_projected}


def test_cached_text_and_start_latent_equal_comfyuis_hunyuan_video_i2v_graph(hv_i2v):
    """Per item: the cond is TextEncodeHunyuanVideo_ImageToVideo's for the item's first frame (2 image tokens in
    front of the caption, and it differs from the caption encoded alone), the start latent is HunyuanImageToVideo
    v1's ``concat_latent_image`` with zero frames after it, and no CLIP-vision features go to the latent entry."""
    cached = _by_source(hv_i2v["result"])
    clip = hv_i2v["clip"]
    for name, pixels in _first_frames(hv_i2v["data"]).items():
        item, example = cached[name]
        theirs = _comfy_graph(clip, hv_i2v["vision"], hv_i2v["vae"], pixels[:1], pixels.shape[0], CAPTIONS[name])
        assert set(example.extras) == {CONCAT_LATENT_ALONE, START_IMAGE_PROMPT}, name
        cond = theirs["cond"][0].float()
        assert example.cond.shape == cond.shape and theirs["mm"].shape[1] == 4, name
        assert torch.allclose(example.cond.float(), cond, rtol=0, atol=1e-6 * cond.abs().max().item()), name
        assert example.extras[START_IMAGE_PROMPT].tolist() == [2], name
        alone = clip.encode_from_tokens(clip.tokenize(CAPTIONS[name]), return_pooled=True, return_dict=True)["cond"]
        assert cond.shape[0] == alone.shape[1] + 2 and not torch.allclose(cond[2:], alone[0].float(), atol=1e-3)
        raw, image = example.extras[CONCAT_LATENT_ALONE], theirs["concat_latent_image"][0]
        assert raw.shape == example.latent.shape == theirs["samples"].shape[1:] and image.shape[1] == 1, name
        assert torch.allclose(raw[:, :1], image, rtol=0, atol=1e-5 * image.abs().max().item()), name
        assert raw[:, 1:].eq(0).all(), name
        mask = theirs["concat_mask"]  # 0 on the start image's latent frame: concat_cond's mask_inverted is 1 there
        assert mask[0, 0, 0].eq(0).all() and mask[0, 0, 1:].eq(1).all(), name
        assert CLIP_VISION_LAST not in example.extras


def test_a_changed_start_image_re_encodes_its_items_text_and_nothing_else(hv_i2v, tmp_path):
    from PIL import Image

    data = tmp_path / "data"
    shutil.copytree(hv_i2v["data"], data)
    shutil.copytree(hv_i2v["root"] / "cache", tmp_path / "cache")
    keys = {Path(i.source).name: (i.latent_key, i.text_key) for i in hv_i2v["result"].items}
    same = hv_i2v["run"](StartImage("first_frame_alone", hv_i2v["vision"]), tmp_path / "cache")
    assert same.report.encoded == {} and same.report.reused == {"latent": 2, "text": 2}
    still = (torch.rand(IMAGE_BUCKET.height, IMAGE_BUCKET.width, 3, generator=torch.Generator().manual_seed(35))
             * 255).to(torch.uint8)
    Image.fromarray(still.numpy()).save(hv_i2v["data"] / "still.png")  # the module's data: restored below
    try:
        changed = hv_i2v["run"](StartImage("first_frame_alone", hv_i2v["vision"]), tmp_path / "cache")
    finally:
        shutil.copy(data / "still.png", hv_i2v["data"] / "still.png")
    assert changed.report.reused == {"latent": 1, "text": 1}
    assert changed.report.reencoded_kinds == {"latent": 1, "text": 1}
    assert all(line.startswith("still.png ") for line in changed.report.reencoded), changed.report.reencoded
    now = {Path(i.source).name: (i.latent_key, i.text_key) for i in changed.items}
    assert now["clip.mp4"] == keys["clip.mp4"] and now["still.png"][1] != keys["still.png"][1]
    other = tiny_llava_vision(tmp_path / "llava_b", 73)  # another CLIP vision model: every text again
    again = hv_i2v["run"](StartImage("first_frame_alone", other), tmp_path / "cache")
    assert again.report.reencoded_kinds == {"text": 2} and again.report.reused == {"latent": 2}
    assert all("clip_vision" in line for line in again.report.reencoded), again.report.reencoded


def test_a_clip_vision_model_without_the_llava_projector_is_refused(hv_i2v, tmp_path):
    from pipetrainer.tests.test_i2v_cache import tiny_clip_vision

    with pytest.raises(ValueError, match="no llava projector.*llava_llama3_vision"):
        hv_i2v["run"](StartImage("first_frame_alone", tiny_clip_vision(tmp_path / "h", 41)), tmp_path / "cache")


def _hv_dm(in_channels: int):
    import dataclasses

    from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams

    config = {"in_channels": in_channels, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 4096,
              "hidden_size": 128, "mlp_ratio": 4.0, "num_heads": 1, "depth": 1, "depth_single_blocks": 0,
              "axes_dim": [16, 56, 56], "theta": 256, "patch_size": [1, 2, 2], "qkv_bias": True,
              "guidance_embed": True, "byt5": False, "meanflow": False, "use_cond_type_embedding": False,
              "vision_in_dim": None, "meanflow_sum": False}
    fields = {f.name for f in dataclasses.fields(HunyuanVideoParams)}
    return HunyuanVideo(image_model="hunyuan_video", device="meta", operations=torch.nn,
                        **{k: v for k, v in config.items() if k in fields})


def test_preflight_names_the_cache_settings_an_i2v_model_misses(comfy_root):
    """HunyuanVideoI2V needs the start latent and captions encoded with the image; SkyReels I2V the latent only; a
    text-to-video cache is refused naming first_frame_alone and llava_llama3_vision."""
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.pipelines.checks import CachedShapes, extra_problems

    adapter = adapter_for("HunyuanVideo")

    def shapes(latent_extras, text_extras):
        return CachedShapes(latents={"l0": (16, 3, 4, 6)}, conds={"t0": (7, 4096)}, pooled={"t0": 768},
                            unreadable=(), extras={"l0": latent_extras, "t0": text_extras},
                            items=(("clip.mp4", "l0", "t0"),))

    i2v, skyreels = adapter.extras(_hv_dm(33)), adapter.extras(_hv_dm(32))
    full = shapes({CONCAT_LATENT_ALONE: (16, 3, 4, 6)}, {START_IMAGE_PROMPT: (1,)})
    assert extra_problems(full, i2v, "HunyuanVideo") == []
    [plain] = extra_problems(shapes({CONCAT_LATENT_ALONE: (16, 3, 4, 6)}, {}), i2v, "HunyuanVideo")
    assert "('start_image_prompt')" in plain and "clip.mp4" in plain and "connect llava_llama3_vision" in plain
    t2v = extra_problems(shapes({}, {}), i2v, "HunyuanVideo")
    assert len(t2v) == 2 and all("first_frame_alone" in p for p in t2v)
    assert extra_problems(shapes({CONCAT_LATENT_ALONE: (16, 3, 4, 6)}, {}), skyreels, "HunyuanVideo") == []
    [sky] = extra_problems(shapes({}, {}), skyreels, "HunyuanVideo")
    assert "first_frame_alone" in sky and "SkyReels I2V takes no CLIP vision model" in sky
    assert START_IMAGE_PROMPT not in skyreels and START_IMAGE_PROMPT not in adapter.extras(_hv_dm(16))


def test_skyreels_i2v_staged_forward_equals_comfyui_after_hunyuanimagetovideo(comfy_root):
    """SkyReels I2V (``HunyuanVideoSkyreelsI2V``, ``concat_keys = ("concat_image",)``: no mask channel), built from
    ComfyUI's own config class: the stages on the cached start latent give ``apply_model`` with the ``c_concat``
    its ``concat_cond`` makes of HunyuanImageToVideo v1's one-frame ``concat_latent_image``."""
    import comfy.supported_models
    from pipetrainer.tests.family_rows.common import from_config
    from pipetrainer.training.pipelines.base import Batch, adapter_for
    from pipetrainer.training.pipelines.hunyuan_video import HunyuanVideoOptions

    unet = {"image_model": "hunyuan_video", "in_channels": 32, "out_channels": 16, "vec_in_dim": 768,
            "context_in_dim": 32, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1,
            "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 256, "patch_size": [1, 2, 2], "qkv_bias": True,
            "guidance_embed": True, "byt5": False, "meanflow": False, "use_cond_type_embedding": False,
            "vision_in_dim": None, "meanflow_sum": False}
    from comfy.ldm.hunyuan_video.model import HunyuanVideoParams

    unet = {k: v for k, v in unet.items() if k in HunyuanVideoParams.__dataclass_fields__ or k == "image_model"}
    model = from_config(comfy.supported_models.HunyuanVideoSkyreelsI2V, unet, seed=81).model
    assert type(model).__name__ == "HunyuanVideoSkyreelsI2V"
    adapter = adapter_for("HunyuanVideo")
    assert adapter.support_problems(model.diffusion_model) == [] and adapter.support_problems(_hv_dm(33)) == []
    assert set(adapter.extras(model.diffusion_model)) == {"attention_mask", CONCAT_LATENT_ALONE}
    g = torch.Generator().manual_seed(82)
    x, raw = torch.randn(1, 16, 3, 4, 6, generator=g), torch.randn(1, 16, 1, 4, 6, generator=g)
    cond, pooled, sigma = torch.randn(1, 5, 32, generator=g), torch.randn(1, 768, generator=g), torch.tensor([0.6])
    mask = torch.ones(1, 1, 3, 4, 6)
    mask[:, :, :1] = 0
    conds = model.extra_conds(noise=x, device=torch.device("cpu"), cross_attn=cond, pooled_output=pooled,
                              guidance=2.0, concat_latent_image=raw, concat_mask=mask)
    start = torch.zeros_like(x)
    start[:, :, :1] = model.process_latent_in(raw)  # the cache's concat_latent_alone, processed like the latent
    t = model.model_sampling.timestep(sigma).float()
    out = adapter.first_stage_inputs(Batch(model.model_sampling.calculate_input(sigma, x), t, cond, pooled,
                                           extras={CONCAT_LATENT_ALONE: start},
                                           options=HunyuanVideoOptions(guidance=2.0)))
    assert out[0].shape[1] == 32 and torch.allclose(out[0][:, 16:], conds["c_concat"].cond, rtol=0, atol=1e-6)
    with torch.no_grad():
        for layer in adapter.stage_layers(model.diffusion_model):
            out = layer(out)
        theirs = model.apply_model(x, sigma, **{k: v.cond for k, v in conds.items()})
    ours = model.model_sampling.calculate_denoised(sigma, out.float(), x)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())
    [odd] = adapter.support_problems(_hv_dm(20))
    assert "4 concatenated input channels" in odd


def test_caption_dropout_gets_each_items_empty_prompt_with_its_start_image(hv_i2v, tmp_path):
    """The empty caption of caption dropout is encoded per item with its start image, as the node encodes ""."""
    from pipetrainer.training.cache.reader import read_entries
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.captions import CaptionOptions
    from pipetrainer.training.data.dataset import scan_dataset

    dataset = scan_dataset(hv_i2v["data"], 32, buckets=SETTINGS, captions=CaptionOptions(dropout=0.5))
    result = build_cache(dataset, hv_i2v["vae"], hv_i2v["clip"], tmp_path / "cache",
                         start_image=StartImage("first_frame_alone", hv_i2v["vision"]))
    items = {Path(i.source).name: i for i in result.items}
    empties = {name: item.empty_text_key for name, item in items.items()}
    assert len(set(empties.values())) == 2 and not set(empties.values()) & {i.text_key for i in items.values()}
    entries = read_entries(items["still.png"].text_file, [empties["still.png"]])
    pixels = _first_frames(hv_i2v["data"])["still.png"]
    theirs = _comfy_graph(hv_i2v["clip"], hv_i2v["vision"], hv_i2v["vae"], pixels[:1], 1, "")["cond"][0].float()
    cond = entries[empties["still.png"]]["cond"].float()
    assert cond.shape == theirs.shape and torch.allclose(cond, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())
    assert entries[empties["still.png"]][START_IMAGE_PROMPT].tolist() == [2]

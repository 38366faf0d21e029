"""LTX-2's Gemma 3 text encoder through the Cache node's text path and into an LTX-2 micro-batch (current ComfyUI).

The encoder is a tiny Gemma 3 written to real safetensors in the real layout (the Gemma file with its SentencePiece
model, the LTX-2 checkpoint with its text projection and a tiny LTX-2 diffusion model) and loaded by the steps of
``LTXAVTextEncoderLoader`` (tests/custom_nodes/pipetrainer_test_nodes/tiny_gemma3.py says what differs: only the
pinned Gemma size). ComfyUI's LTX-2 encoder pads every prompt on the left to 1024 tokens, runs Gemma with the
attention mask, then keeps only the caption's own tokens and projects all hidden states to the caption width;
its conditioning carries no attention mask, only the flag ``unprocessed_ltxav_embeds`` for ``LTXAV.extra_conds``.
Both text layouts run: LTX-2's (one projection to the model's caption width; its connectors, then its caption
projections) and LTX-2.3's (two projections, video and audio side by side, taken as they are by the connectors).

- The cached cond of each caption is CLIPTextEncode's (exactly at fp32, its bf16 rounding at the Cache node's
  default bf16), as long as the caption's tokens (no padding), as wide as the adapter's caption width.
- No attention mask is cached (none is given; the padding is already cut), though the Gemma inside returns one.
- Two captions of different lengths, read back as training reads them, batch into one LTX-2 micro-batch; its
  embed stage gives each caption's connector output exactly as ``LTXAV.extra_conds`` gives it at sampling.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from pipetrainer.tests.family_rows.ltx2 import CAPTION, ltx2_small

CAPTIONS = ("a red chair", "a small grey cat asleep on a wooden bench in the afternoon sun")
TE_KEY = "gemma3_12b"  # ComfyUI's name of the Gemma tokens and model in the LTX-2 text encoder


def ltx23_small(seed: int = 61):
    """The family row's tiny LTX-2 in LTX-2.3's text layout: the text encoder gives the video and audio context side by
    side (its two projections), taken as they are before the embeddings connectors (64 wide, as each stream)."""
    import comfy.supported_models
    from pipetrainer.tests.family_rows.common import from_config

    unet = {"image_model": "ltxav", "num_layers": 2, "attention_head_dim": 2, "num_attention_heads": 32,
            "cross_attention_dim": 64, "audio_attention_head_dim": 2, "audio_num_attention_heads": 32,
            "audio_cross_attention_dim": 64, "caption_channels": CAPTION, "in_channels": 128,
            "audio_in_channels": 128, "connector_attention_head_dim": 2, "connector_num_attention_heads": 32,
            "connector_num_layers": 1, "caption_proj_before_connector": True, "caption_projection_first_linear": False}
    return from_config(comfy.supported_models.LTXAV, unet, seed=seed)


# layout: (its tiny model, the checkpoint's text projection widths: video, and audio or None)
LAYOUTS = {"LTX-2": (ltx2_small, (CAPTION, None)), "LTX-2.3": (ltx23_small, (64, 64))}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def te(request, comfy_root, tmp_path_factory):
    """``(clip, LTX-2 BaseModel)``: the tiny encoder loaded from its two files, and the tiny LTX-2 whose weights the
    checkpoint file carries (LTX-2: the family row; LTX-2.3: :func:`ltx23_small`)."""
    from pipetrainer.tests.family_rows.common import require_model_class

    require_model_class("LTXAV")
    from pipetrainer.tests.custom_nodes.pipetrainer_test_nodes import tiny_gemma3
    from safetensors.torch import save_file

    build, (video, audio) = LAYOUTS[request.param]
    model = build().model
    folder = tmp_path_factory.mktemp("ltx2_te")
    checkpoint = {f"model.diffusion_model.{k}": v.contiguous() for k, v in model.diffusion_model.state_dict().items()}
    checkpoint.update(tiny_gemma3.projection_state(video, seed=3840, audio_width=audio))
    save_file(tiny_gemma3.gemma3_state(seed=12), str(folder / "gemma_3_tiny.safetensors"))
    save_file(checkpoint, str(folder / "ltx-2-tiny.safetensors"))
    clip = tiny_gemma3.load_ltxav_text_encoder(str(folder / "gemma_3_tiny.safetensors"),
                                               str(folder / "ltx-2-tiny.safetensors"))
    yield clip, model
    _encode.cache_clear()


@functools.cache
def _encode(clip, caption: str):
    """ComfyUI's CLIPTextEncode of ``caption``: ``(cond [1, T, D], its dict)``."""
    import nodes as comfy_nodes

    ((cond, extra),) = comfy_nodes.CLIPTextEncode().encode(clip, caption)[0]
    return cond, extra


def _own_tokens(clip, caption: str) -> int:
    """The caption's tokens in ComfyUI's tokenization (BOS included), without the left padding to 1024."""
    (batch,) = clip.tokenize(caption)[TE_KEY]
    assert len(batch) == 1024 and batch[0][0] == 0  # left-padded: the padding the encoder must cut again
    return sum(1 for token, _ in batch if token != 0)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from PIL import Image

    folder = tmp_path_factory.mktemp("ltx2_te_data")
    for i, caption in enumerate(CAPTIONS):
        Image.new("RGB", (64, 64), (40 + 90 * i, 200 - 70 * i, 30 + 50 * i)).save(folder / f"item{i}.png")
        (folder / f"item{i}.txt").write_text(caption, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def caches(te, encoders, dataset, tmp_path_factory):
    """The dataset cached by the Cache node's path with the tiny VAE and the LTX-2 text encoder, text stored as
    fp32 and as bf16 (the node's default): ``{dtype: CacheResult}``."""
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import scan_dataset

    root = tmp_path_factory.mktemp("ltx2_te_cache")
    clip = te[0]
    return {dtype: build_cache(scan_dataset(dataset, 64), encoders[0], clip, root / dtype, text_dtype=dtype)
            for dtype in ("fp32", "bf16")}


def test_the_cached_text_is_clip_text_encodes_cond_at_the_captions_own_length(te, caches):
    from pipetrainer.training.cache.reader import read_entries
    from pipetrainer.training.pipelines.base import adapter_for

    clip, model = te
    width = adapter_for("LTX2").conditioning_dims(model.diffusion_model)[0]
    lengths = {}
    for dtype, stored in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        result = caches[dtype]
        assert result.report.encoded == {"latent": 2, "text": 2} and not result.report.skipped
        assert (result.text_dim, result.pooled_dim) == (width, 0)  # the adapter's caption width; no pooled vector
        for item in result.items:
            entry = read_entries(item.text_file, [item.text_key])[item.text_key]
            cond, extra = _encode(clip, item.caption)
            assert cond.shape == (1, _own_tokens(clip, item.caption), width) and torch.isfinite(cond).all()
            assert entry["cond"].dtype == stored
            assert torch.equal(entry["cond"], cond[0].to(stored))  # fp32: exactly; bf16: its rounding
            assert sorted(entry) == ["cond"]  # nothing else given: no pooled, no mask, no text extra
            lengths[item.caption] = entry["cond"].shape[0]
    assert len(set(lengths.values())) == 2 and all(n < 1024 for n in lengths.values())


def test_no_attention_mask_is_cached_since_the_encoder_cuts_the_padding(te, caches):
    """Gemma inside returns a mask (so the cache's identity says so), ComfyUI's LTX-2 encoder consumes it: the
    conditioning, the cache and the adapter's extras have none. What the conditioning gives instead, the flag
    ``unprocessed_ltxav_embeds``, is not cached: the embed stage supplies it from the model's layout (the next test
    checks that against ``extra_conds`` with the flag; on LTX-2.3's layout the result depends on it)."""
    from pipetrainer.training.cache.encoders import TEXT_ATTENTION_MASK, returns_attention_mask, text_encoder_identity
    from pipetrainer.training.pipelines.base import adapter_for

    clip, model = te
    assert returns_attention_mask(clip) and text_encoder_identity(clip)["attention_mask"] is True
    for caption in CAPTIONS:
        _, extra = _encode(clip, caption)
        assert TEXT_ATTENTION_MASK not in extra and extra.get("unprocessed_ltxav_embeds") is True
    assert TEXT_ATTENTION_MASK not in adapter_for("LTX2").extras(model.diffusion_model)


def test_captions_of_two_lengths_batch_for_ltx2_as_extra_conds_gives_them(te, caches):
    """Read back as training reads them (``load_examples``), the two conds share one micro-batch (zeros after the
    shorter, each caption's own token count handed on); the embed stage's connector output of each equals
    ``LTXAV.extra_conds`` of CLIPTextEncode's conditioning, and the whole embed runs."""
    from pipetrainer.tests.family_rows.ltx2 import AUDIO_FRAMES, LATENT
    from pipetrainer.training.data.micro_batches import MicroBatches, load_examples
    from pipetrainer.training.pipelines.base import adapter_for
    from pipetrainer.training.pipelines.ltx2 import LTX2Options
    from pipetrainer.training.spec.options import TimestepSpec

    clip, model = te
    adapter = adapter_for("LTX2")
    items = caches["fp32"].items
    g = torch.Generator().manual_seed(0)
    examples = [e.__class__(torch.randn(*LATENT, generator=g), e.cond, e.pooled,
                            {**e.extras, "audio_latent": torch.randn(8, AUDIO_FRAMES, 16, generator=g)})
                for e in load_examples(items)]  # LTX-2's latents: the text entries are what is under test
    by_length = {e.cond.shape[0]: item.caption for e, item in zip(examples, items, strict=True)}
    inputs, _ = MicroBatches(examples, 2, 3, model, adapter, TimestepSpec(), torch.device("cpu"),
                             family_options=LTX2Options()).build(0)
    cond, tokens = inputs[3], inputs[4]
    assert cond.shape == (2, max(by_length), adapter.conditioning_dims(model.diffusion_model)[0])
    assert sorted(tokens.view(-1).tolist()) == sorted(by_length)
    embed = adapter.stage_layers(model.diffusion_model)[0]
    with torch.no_grad():
        connected = embed._connected_text(cond, tokens)
        out = embed(inputs)
    assert out[2].shape[:2] == out[3].shape[:2] == connected.shape[:2] and torch.isfinite(out[2]).all()
    for i, n in enumerate(tokens.view(-1).tolist()):
        assert cond[i, n:].eq(0).all()  # the shorter caption is followed by zeros the connectors never see
        comfy_cond, extra = _encode(clip, by_length[n])
        conds = model.extra_conds(cross_attn=comfy_cond, device=torch.device("cpu"),
                                  unprocessed_ltxav_embeds=extra["unprocessed_ltxav_embeds"])
        expected = conds["c_crossattn"].cond[0]  # the connectors' output: their own length, both streams' widths
        assert connected.shape[1:] == expected.shape
        assert torch.allclose(connected[i], expected, atol=1e-6, rtol=1e-5)

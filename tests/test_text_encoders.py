"""The LLM text encoders of Lumina 2 (Gemma 2), Z-Image (Qwen3), FLUX.2 dev (Mistral 3) and FLUX.2 Klein
(Qwen3, current ComfyUI): tiny ones from ComfyUI's own classes (test node pack,
tests/custom_nodes/pipetrainer_test_nodes) through the Cache node's encode path and into one trained
micro-batch.

- The Cache node's text entry for a caption is exactly the conditioning ComfyUI's CLIPTextEncode gives
  with the same CLIP: the cond (the encoder's template, hidden layer and Klein's three stacked layers)
  and the text attention mask; neither encoder gives a pooled vector.
- The encoder's identity in the cache key is the same for the same weights and differs between seeds.
- One micro-batch of those cached conds, assembled by ``MicroBatches`` as training does, through the
  family's stage layers with a LoRA injected, equals ComfyUI's sampling forward of the same caption
  (``extra_conds`` of CLIPTextEncode's conditioning, then ``apply_model``), and its loss back-propagates
  into the LoRA. The tiny diffusion models' caption widths match the tiny encoders' outputs.

FLUX.2 dev's Mistral rows run only where ComfyUI can build its Mistral tokenizer with the installed
transformers (``tiny_mistral.mistral_tokenizer_problem``): on ComfyUI 0.3.75 with transformers 4.x (the
dev lock's 4.57), on later ComfyUI with transformers <= 5.14; transformers >= 5.15 breaks it upstream.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from pipetrainer.tests.custom_nodes.pipetrainer_test_nodes import tiny_gemma2, tiny_mistral, tiny_qwen3
from pipetrainer.tests.family_rows.lumina2 import LUMINA_CONTEXT, ZIMAGE_CONTEXT, lumina2_small, zimage_small

CAPTIONS = ("a red chair", "a small grey cat asleep on a wooden bench in the afternoon sun")
KLEIN_CONTEXT = 3 * tiny_qwen3.KLEIN_HIDDEN  # Flux2TEModel stacks three hidden states
MISTRAL_CONTEXT = 3 * tiny_mistral.HIDDEN


def flux2_small(context: int, guidance_embed: bool, seed: int = 1):
    """FLUX.2's layout (Flux2 config class; dev with, Klein without a guidance embedding) at hidden 64,
    caption width ``context``, 16 latent channels (the tiny TAESD's), in memory."""
    import comfy.supported_models
    from comfy.ldm.flux.model import FluxParams
    from pipetrainer.devkit.fixtures import flux_params
    from pipetrainer.tests.family_rows.common import from_config

    unet = {"image_model": "flux2", **flux_params(
        in_channels=16, out_channels=16, vec_in_dim=None, context_in_dim=context, hidden_size=64, mlp_ratio=3.0,
        num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 8, 8, 8], theta=2000, patch_size=1, qkv_bias=False,
        guidance_embed=guidance_embed, global_modulation=True, mlp_silu_act=True, ops_bias=False, default_ref_method="index",
        ref_index_scale=10.0)}
    if "txt_ids_dims" in FluxParams.__dataclass_fields__:
        unet["txt_ids_dims"] = [3]
    return from_config(comfy.supported_models.Flux2, unet, seed=seed)


# name: (tiny CLIP builder, width of its cond, family, tiny diffusion model of that width)
ENCODERS = {
    "Gemma2": (tiny_gemma2.tiny_gemma2_clip, LUMINA_CONTEXT, "Lumina2", lumina2_small),
    "ZImageQwen3": (tiny_qwen3.tiny_zimage_qwen3_clip, ZIMAGE_CONTEXT, "Lumina2", zimage_small),
    "Mistral3": (tiny_mistral.tiny_mistral_clip, MISTRAL_CONTEXT, "Flux2",
                 functools.partial(flux2_small, MISTRAL_CONTEXT, True)),
    "KleinQwen3": (tiny_qwen3.tiny_klein_qwen3_clip, KLEIN_CONTEXT, "Flux2",
                   functools.partial(flux2_small, KLEIN_CONTEXT, False)),
}


@functools.cache
def _clip(name: str, seed: int | None = None):
    build = ENCODERS[name][0]
    return build() if seed is None else build(seed)


@pytest.fixture(scope="module", autouse=True)
def _release_encoders():
    """Free the module's cached CLIPs while ComfyUI is still whole (not at interpreter exit)."""
    yield
    import gc

    for cached_function in (_encode, _cached, _clip):
        cached_function.cache_clear()
    gc.collect()


def _needs_host(name: str) -> None:
    if name == "KleinQwen3" and not tiny_qwen3.has_klein():
        pytest.skip("ComfyUI 0.3.75 has no FLUX.2 Klein text encoder (comfy.text_encoders.flux.klein_te)")
    if name == "Mistral3" and (problem := tiny_mistral.mistral_tokenizer_problem()):
        pytest.skip(problem)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Two 64 px images with captions of different lengths."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("te_data")
    for i, caption in enumerate(CAPTIONS):
        Image.new("RGB", (64, 64), (40 + 90 * i, 200 - 70 * i, 30 + 50 * i)).save(folder / f"item{i}.png")
        (folder / f"item{i}.txt").write_text(caption, encoding="utf-8")
    return folder


@functools.cache
def _cached(name: str, folder: Path, cache_dir: Path, vae):
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.dataset import scan_dataset

    return build_cache(scan_dataset(folder, 64), vae, _clip(name), cache_dir / name, text_dtype="fp32")


@pytest.fixture(params=list(ENCODERS))
def cached(request, comfy_root, encoders, dataset, tmp_path_factory):
    """``(name, CacheResult)``: the dataset cached with the tiny VAE and the encoder ``name``."""
    _needs_host(request.param)
    return request.param, _cached(request.param, dataset, tmp_path_factory.getbasetemp(), encoders[0])


@functools.cache
def _encode(name: str, caption: str):
    """ComfyUI's CLIPTextEncode of ``caption`` with the tiny encoder ``name`` (once per caption: Klein's
    512 tokens through 28 layers are the slow part of these tests)."""
    import nodes as comfy_nodes

    (conditioning,) = comfy_nodes.CLIPTextEncode().encode(_clip(name), caption)
    return conditioning


def test_the_cached_text_is_clip_text_encodes_conditioning(cached):
    from pipetrainer.training.cache.encoders import TEXT_ATTENTION_MASK
    from pipetrainer.training.cache.reader import read_entries

    name, result = cached
    width = ENCODERS[name][1]
    assert result.text_dim == width and result.pooled_dim == 0
    assert sorted(item.caption for item in result.items) == sorted(CAPTIONS)
    for item in result.items:
        entry = read_entries(item.text_file, [item.text_key])[item.text_key]
        ((cond, extra),) = _encode(name, item.caption)
        assert extra.get("pooled_output") is None and "pooled" not in entry
        assert cond.shape[-1] == width and torch.isfinite(cond).all()
        assert torch.equal(entry["cond"], cond[0].float())
        assert torch.equal(entry[TEXT_ATTENTION_MASK], extra["attention_mask"][0])
    lengths = {item.caption: read_entries(item.text_file, [item.text_key])[item.text_key]["cond"].shape[0]
               for item in result.items}
    if name == "KleinQwen3":  # Klein's tokenizer pads every caption to 512 tokens, the mask says which are text
        assert set(lengths.values()) == {512}
    else:  # no padding: the longer caption has more tokens
        assert lengths[CAPTIONS[1]] > lengths[CAPTIONS[0]]


@pytest.mark.parametrize("name", list(ENCODERS))
def test_the_encoder_identity_is_stable_and_seeded(name, comfy_root):
    from pipetrainer.training.cache import keys
    from pipetrainer.training.cache.encoders import text_encoder_identity

    _needs_host(name)
    build = ENCODERS[name][0]
    first, again, other = text_encoder_identity(_clip(name)), text_encoder_identity(build()), text_encoder_identity(
        _clip(name, 12345))
    assert first == again
    assert first["attention_mask"] is True  # the mask is cached (and keyed) for these encoders
    assert {k for k in first if first[k] != other[k]} == {"weights"}
    key = functools.partial(keys.text_key, CAPTIONS[0])
    assert key(keys.encoder_signature(first)) == key(keys.encoder_signature(again))
    assert key(keys.encoder_signature(first)) != key(keys.encoder_signature(other))


@pytest.mark.parametrize("name", list(ENCODERS))
def test_only_the_transformers_size_differs_from_comfyuis_encoder(name, comfy_root):
    """The tiny inner model is a subclass of ComfyUI's own, built with that class's defaults: the hidden
    layer(s) read (Gemma 2 / Z-Image: the second-to-last layer's output; Klein: the inputs of layers 9, 18
    and 27, stacked), inside the tiny depth as inside the real one, with attention masks on."""
    import inspect

    _needs_host(name)
    te = _clip(name).cond_stage_model
    inner = getattr(te, te.clip)
    comfy_class = type(inner).__mro__[1]
    assert comfy_class.__module__.startswith("comfy.text_encoders."), comfy_class
    defaults = {k: p.default for k, p in inspect.signature(comfy_class.__init__).parameters.items()}
    assert (inner.layer, inner.layer_idx) == (defaults["layer"], defaults["layer_idx"])
    assert inner.enable_attention_masks and inner.return_attention_masks and defaults["attention_mask"] is True
    depth = inner.transformer.num_layers
    if isinstance(inner.layer, list):  # hidden_states indices (a layer's input), 0 ..= depth: inside the stack
        read = inner.layer
        assert all(0 <= i < depth for i in read), (read, depth)
    else:  # the output of layer layer_idx (from the end if negative): not the last one, as on the real model
        read = [inner.layer_idx]
        assert -depth <= inner.layer_idx and inner.layer_idx % depth < depth - 1, (inner.layer_idx, depth)
    assert inner.transformer.model.embed_tokens.weight.shape[1] * len(read) == ENCODERS[name][1]


def _comfy_forward(model, conditioning, noisy: torch.Tensor, sigma: torch.Tensor, options) -> torch.Tensor:
    """ComfyUI's sampling forward of one CLIPTextEncode conditioning: its model conds (``extra_conds``,
    as ``comfy.samplers.encode_model_conds`` calls it) into ``BaseModel.apply_model``. A family option
    ``guidance`` goes into the conditioning as ComfyUI's FluxGuidance node puts it there."""
    from comfy.sampler_helpers import convert_cond

    (params,) = convert_cond(conditioning)
    if hasattr(options, "guidance"):
        params["guidance"] = options.guidance
    params.update(device=noisy.device, noise=noisy, width=noisy.shape[3] * 8, height=noisy.shape[2] * 8,
                  prompt_type="positive")
    conds = model.extra_conds(**params)
    with torch.no_grad():
        return model.apply_model(noisy, sigma, **{k: c.cond for k, c in conds.items()})


def test_one_micro_batch_of_the_cached_conds_trains_as_comfyui_samples(cached):
    from pipetrainer.training.adapters.inject import freeze_all_but_lora, inject_lora, named_lora_parameters
    from pipetrainer.training.data.micro_batches import MicroBatches, load_examples
    from pipetrainer.training.objective.loss import mse_loss
    from pipetrainer.training.pipelines.base import adapter_for, family_name_for
    from pipetrainer.training.spec.options import LoraSpec, TimestepSpec

    name, result = cached
    _, width, family, build_model = ENCODERS[name]
    model = build_model().model
    assert family_name_for(model) == family
    adapter = adapter_for(family)
    assert adapter.conditioning_dims(model.diffusion_model) == (width, 0)
    layers = adapter.stage_layers(model.diffusion_model)
    indexed = list(enumerate(layers, start=1))
    assert inject_lora(indexed, adapter.lora_target_regex("attention"), LoraSpec(rank=4, alpha=4.0,
                                                                                 targets="attention"), seed=3) > 0
    stage = torch.nn.ModuleDict({str(i): layer for i, layer in indexed})
    freeze_all_but_lora(stage)

    examples = load_examples(list(result.items), text_dtype=torch.float32)
    batches = MicroBatches(examples, 1, 5, model, adapter, TimestepSpec(), torch.device("cpu"),
                           family_options=adapter.options_type())
    g = torch.Generator().manual_seed(11)
    for item, example, sigma in zip(result.items, examples, (0.3, 0.8), strict=True):  # one example per item
        x0 = batches.processed_latents([example.latent])
        noise = torch.randn(x0.shape, generator=g)
        sigmas = torch.tensor([sigma])
        inputs, target = batches.assemble([example], x0, noise, sigmas)
        out = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
        for layer in layers:
            out = layer(out)
        noisy = model.model_sampling.noise_scaling(sigmas.view(-1, 1, 1, 1), noise, x0)
        ours = model.model_sampling.calculate_denoised(sigmas, out.detach().float(), noisy)
        theirs = _comfy_forward(model, _encode(name, item.caption), noisy, sigmas, adapter.options_type())
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item()), (ours - theirs).abs().max()

        stage.zero_grad()
        mse_loss(out, target).backward()
        grads = {k: p.grad for k, p in named_lora_parameters(stage).items() if ".lora_B." in k}
        assert grads and all(v is not None and torch.isfinite(v).all() for v in grads.values())
        assert any(v.abs().max() > 0 for v in grads.values())


def test_the_lumina2_examples_prompt_prefix_caches_what_its_clip_text_encode_lumina2_gives(
        comfy_root, encoders, dataset, tmp_path):
    """Lumina 2 samples through ``CLIPTextEncodeLumina2`` (system prompt + " <Prompt Start> " + prompt).
    With the Lumina 2 example's ``prompt_prefix`` (workflows/api/pipetrainer_lumina2.json) every cached
    caption and the empty caption (caption dropout) equal that node's conditioning, with the system
    prompt the example samples with, of the caption and of an empty prompt (tiny Gemma 2)."""
    import json

    from comfy_extras.nodes_lumina2 import CLIPTextEncodeLumina2
    from pipetrainer.training.cache.encoders import TEXT_ATTENTION_MASK
    from pipetrainer.training.cache.reader import read_entries
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.captions import CaptionOptions
    from pipetrainer.training.data.dataset import scan_dataset

    example = json.loads((Path(__file__).resolve().parent.parent / "workflows" / "api" / "pipetrainer_lumina2.json").read_text())
    (prefix,) = [n["inputs"]["prompt_prefix"] for n in example.values() if n["class_type"] == "PipeTrainerDataset"]
    (system,) = [n["inputs"]["system_prompt"] for n in example.values() if n["class_type"] == "CLIPTextEncodeLumina2"]
    clip = _clip("Gemma2")
    spec = scan_dataset(dataset, 64, captions=CaptionOptions(dropout=0.5, prefix=prefix))
    result = build_cache(spec, encoders[0], clip, tmp_path / "cache", text_dtype="fp32")

    def lumina2(prompt: str):
        ((cond, extra),) = CLIPTextEncodeLumina2.execute(clip=clip, user_prompt=prompt, system_prompt=system).result[0]
        return cond[0].float(), extra["attention_mask"][0]

    assert sorted(item.caption for item in result.items) == sorted(CAPTIONS)
    for item in result.items:
        entries = read_entries(item.text_file, [item.text_key, item.empty_text_key])
        for key, prompt in ((item.text_key, item.caption), (item.empty_text_key, "")):
            cond, mask = lumina2(prompt)
            assert torch.equal(entries[key]["cond"], cond) and torch.equal(entries[key][TEXT_ATTENTION_MASK], mask)
        alone = _encode("Gemma2", item.caption)[0][0]  # CLIPTextEncode of the caption without the prefix
        assert entries[item.text_key]["cond"].shape[0] > alone.shape[1]


@pytest.mark.parametrize("name", ["Gemma2", "ZImageQwen3"])
def test_the_text_disk_estimate_grows_with_llm_captions_as_the_stored_entries_do(name, comfy_root, encoders, dataset,
                                                                               tmp_path):
    """LLM encoders give one row per token (no padding): the disk estimate's text elements, from one
    encode of the empty prompt and the captions' token counts, cover what a real cache run stores for
    short and long captions behind a prompt prefix and the empty caption, and stay close to it."""
    from pipetrainer.nodes.checks.preflight import dataset_texts, text_cache_elements
    from pipetrainer.training.cache.reader import read_entries
    from pipetrainer.training.cache.store import build_cache
    from pipetrainer.training.data.captions import CaptionOptions
    from pipetrainer.training.data.dataset import scan_dataset

    clip = _clip(name)
    spec = scan_dataset(dataset, 64, captions=CaptionOptions(dropout=0.1, prefix="A picture. "))
    result = build_cache(spec, encoders[0], clip, tmp_path / "cache", text_dtype="fp32")
    keys = {k for item in result.items for k in (item.text_key, *item.text_variants, item.empty_text_key) if k}
    stored = sum(t.numel() for entry in read_entries(result.items[0].text_file, keys).values() for t in entry.values())
    estimated = text_cache_elements(dataset_texts(spec), clip)
    assert len(keys) == len(dataset_texts(spec)) == 3  # 2 captions + the empty caption
    assert stored <= estimated <= 1.1 * stored, (stored, estimated)

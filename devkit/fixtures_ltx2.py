"""A tiny LTX-2 all-in-one checkpoint that ComfyUI's own loaders accept (current ComfyUI only: LTXAV).

LTX-2 ships as one checkpoint: the audio-video transformer (``model.diffusion_model.*``), the video VAE
(``vae.*``), the audio VAE and its vocoder (``audio_vae.*``, ``vocoder.*``) and the text projection of
Gemma's hidden states (``text_embedding_projection.*``), with the architecture in the safetensors metadata
(``config``: ``transformer``, ``vae``, ``audio_vae``, ``vocoder``). ComfyUI reads that metadata: detection of
the transformer pins only 32 heads (the head width is ``attn2.to_k`` rows / 32) and updates the rest from
``config["transformer"]``; the video VAE and the audio VAE are built from ``config["vae"]`` /
``config["audio_vae"]`` + ``config["vocoder"]``. So the stock ``CheckpointLoaderSimple`` (and the pack's
``Load Checkpoint (PipeTrainer)``, whose recipe the training ranks replay) and ``LTXVAudioVAELoader`` load this
file as they load the real one, with tiny widths:

- transformer: tests/family_rows/ltx2.py's ``ltx2_small`` layout (video and audio streams 64 wide, 2 blocks,
  caption width 16, 128 latent channels): about 0.6 M parameters;
- video VAE: ComfyUI's ``VideoVAE`` with 4x4 patches and three ``compress_all`` stages (32x spatial, 8x
  temporal, as the real one), 8 base channels, one residual layer per stage, 128 latent channels;
- audio VAE: tests/test_ltx2_audio.py's tiny ``AudioVAE`` (16 kHz, 64 mels, 8 base channels, a small vocoder);
- text projection: tests/custom_nodes/pipetrainer_test_nodes/tiny_gemma3.py's (the tiny Gemma 3's stacked
  hidden states to the caption width 16).

Every weight is seeded (float32); the same seed writes the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

LTX2_CHECKPOINT_FILE = "pipetrainer-tiny-ltx2.safetensors"
GEMMA3_FILE = "pipetrainer-tiny-gemma3.safetensors"
CAPTION = 16  # the transformer's caption width: the text projection's output
AUDIO_SR = 16000

TRANSFORMER = {"num_layers": 2, "attention_head_dim": 2, "num_attention_heads": 32, "cross_attention_dim": 64,
               "audio_attention_head_dim": 2, "audio_num_attention_heads": 32, "audio_cross_attention_dim": 64,
               "caption_channels": CAPTION, "in_channels": 128, "audio_in_channels": 128,
               "connector_attention_head_dim": 8, "connector_num_attention_heads": 2, "connector_num_layers": 1}

VIDEO_VAE = {"_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3,
             "latent_channels": 128, "patch_size": 4, "norm_layer": "pixel_norm", "latent_log_var": "uniform",
             "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": False,
             "scaling_factor": 1.0, "encoder_base_channels": 8, "decoder_base_channels": 8,
             "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_all_res", {"multiplier": 2}],
                                ["res_x", {"num_layers": 1}], ["compress_all_res", {"multiplier": 2}],
                                ["res_x", {"num_layers": 1}], ["compress_all_res", {"multiplier": 2}],
                                ["res_x", {"num_layers": 1}]],
             "decoder_blocks": [["res_x", {"num_layers": 1, "inject_noise": False}],
                                ["compress_all", {"residual": True, "multiplier": 2}],
                                ["res_x", {"num_layers": 1, "inject_noise": False}],
                                ["compress_all", {"residual": True, "multiplier": 2}],
                                ["res_x", {"num_layers": 1, "inject_noise": False}],
                                ["compress_all", {"residual": True, "multiplier": 2}],
                                ["res_x", {"num_layers": 1, "inject_noise": False}]]}

AUDIO_VAE = {"model": {"params": {"ddconfig": {
    "double_z": True, "mel_bins": 64, "z_channels": 8, "resolution": 256, "downsample_time": False, "in_channels": 2,
    "out_ch": 2, "ch": 8, "ch_mult": [1, 2, 4], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0,
    "mid_block_add_attention": False, "norm_type": "pixel", "causality_axis": "height"}, "sampling_rate": AUDIO_SR}},
    "preprocessing": {"stft": {"filter_length": 1024, "hop_length": 160}}}
VOCODER = {"upsample_initial_channel": 8, "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]],
           "upsample_rates": [4, 4], "upsample_kernel_sizes": [8, 8]}


def checkpoint_config() -> dict:
    return {"transformer": TRANSFORMER, "vae": VIDEO_VAE, "audio_vae": AUDIO_VAE, "vocoder": VOCODER}


def _seeded_audio_vae_state(state: dict, seed: int) -> dict:
    """tests/test_ltx2_audio.py's weights: N(0, 0.2) everywhere, per-channel std statistics near 1 (N(1, 0.5))."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():  # the module's own order, as the fixture there fills it
        if not t.is_floating_point():
            out[name] = t.clone()
            continue
        scale = 0.5 if "std" in name else 0.2
        out[name] = (torch.randn(t.shape, generator=g) * scale + (1.0 if "std" in name else 0.0)).float().contiguous()
    return out


def tiny_ltx2_checkpoint_state(seed: int = 2626) -> dict:
    """The checkpoint's tensors, keyed as the real LTX-2 checkpoint keys them."""
    import torch
    from comfy.ldm.lightricks.av_model import LTXAVModel
    from comfy.ldm.lightricks.vae.audio_vae import AudioVAE
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    from .fixtures import _randomize_scaled

    def plain(module) -> dict:
        return {k: torch.empty(v.shape, dtype=torch.float32) for k, v in module.state_dict().items()
                if v.is_floating_point()}

    transformer = LTXAVModel(**TRANSFORMER, device="meta", operations=torch.nn)
    state = {f"model.diffusion_model.{k}": v for k, v in _randomize_scaled(plain(transformer), seed).items()}
    video_vae = VideoVAE(config=VIDEO_VAE)
    state.update({f"vae.{k}": v for k, v in _randomize_scaled(plain(video_vae), seed + 1).items()})
    audio = AudioVAE({"config": {"audio_vae": AUDIO_VAE, "vocoder": VOCODER}})
    for k, v in _seeded_audio_vae_state(audio.state_dict(), seed + 2).items():
        head, rest = k.split(".", 1)
        state[f"{'audio_vae' if head == 'autoencoder' else head}.{rest}"] = v
    from pipetrainer.tests.custom_nodes.pipetrainer_test_nodes import tiny_gemma3

    state.update(tiny_gemma3.projection_state(CAPTION, seed=seed + 3))
    return state


def build_tiny_ltx2_checkpoint(path: Path, seed: int = 2626) -> Path:
    """Write the tiny LTX-2 checkpoint (see the module docstring) to ``path``."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tiny_ltx2_checkpoint_state(seed), str(path), metadata={"config": json.dumps(checkpoint_config())})
    return path


def build_tiny_gemma3(path: Path, seed: int = 12) -> Path:
    """Write the tiny Gemma 3 text encoder file (tiny_gemma3.gemma3_state) to ``path``."""
    from pipetrainer.tests.custom_nodes.pipetrainer_test_nodes import tiny_gemma3
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tiny_gemma3.gemma3_state(seed), str(path))
    return path

"""LTX-2 end to end on a real ComfyUI server (current ComfyUI only): the example workflow
(workflows/api/pipetrainer_ltx2.json) caches a dataset of clips with sound, trains a LoRA on 1 and on 2 pipeline
stages (bitwise-equal files), and samples video with sound from the trained MODEL in the same graph.

The checkpoint is a tiny all-in-one LTX-2 file (devkit/fixtures_ltx2.py): transformer, video VAE, audio VAE and
vocoder, text projection, with its architecture in the safetensors metadata as the real one carries it, so
ComfyUI's own loaders build it (the pack's ``Load Checkpoint (PipeTrainer)``, whose recipe the training ranks
replay, and the stock ``LTXVAudioVAELoader``). Only the text encoder loader is swapped: the stock
``LTXAVTextEncoderLoader`` pins Gemma 3 at 12 B, so a test-only node runs its steps with a tiny Gemma 3
(tests/custom_nodes/pipetrainer_test_nodes/tiny_ltx2.py). Everything else is the example graph, tiny: LTXVConditioning,
EmptyLTXVLatentVideo + LTXVEmptyLatentAudio joined by LTXVConcatAVLatent, LTXVScheduler, CFGGuider over Train LoRA's
MODEL, SamplerCustomAdvanced, LTXVSeparateAVLatent, the video and audio decodes, SaveAnimatedWEBP and SaveAudio.

The dataset: 4 clips of 9 frames at 128 px written with PyAV, H.264 and VP9 video, three with sound (AAC in MP4,
Opus in WebM) and one silent (no audio stream), each with a caption. The graph is queued twice, 1 and 2 pipeline
stages (fp32, 3 steps, layers split uniformly), with a second sample from the untrained MODEL beside the trained one.

Checked: the cache report (4 latents and texts, one bucket); each cached audio latent (read back from the cache the
runs' specs name): the silent clip's is the encoding of silence of its kept span, the others their own sound; both runs
replayed the checkpoint recipe and trained every step; the two LoRAs are bitwise equal and trained; ComfyUI's own
LoRA loader maps every module of the file (here, and no "lora key not loaded" in the server); each graph saved 9
frames at 128 px and stereo sound as long as the clip, which differs from the untrained MODEL's and is the same for
1 and 2 stages. Takes about 80 s on 2 CPU cores.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from pipetrainer.devkit.host import ComfyServer, extra_custom_nodes_args, history_error, output_images
from pipetrainer.training.process.events import read_all
from safetensors.torch import load_file

PACK = Path(__file__).resolve().parent.parent
WORKFLOW = PACK / "workflows" / "api" / "pipetrainer_ltx2.json"
TEST_NODES = Path(__file__).resolve().parent / "custom_nodes"
CKPT, TEXT, AUDIO_VAE, DATASET, CACHE, LORA, OPTIMIZER, TRAIN = "1", "2", "3", "4", "5", "6", "7", "8"
LATENT, AUDIO_LATENT, SCHEDULER, GUIDER, SAMPLER = "12", "13", "15", "18", "19"
DECODE, SAVE, SAVE_AUDIO = "21", "23", "24"
BASE_GUIDER, SAVE_BASE_AUDIO = "30", "34"  # added: the same sample from the untrained MODEL
FPS = 25
FRAMES = 9  # one 8k+1 bucket: 2 latent frames
SIZE = 128  # 4x4 latent pixels (the VAE is 32x): the fewest Train accepts

# name -> (container, video codec, audio codec or None)
CLIPS = {
    "talk": ("mp4", "libx264", "aac"),
    "song": ("webm", "libvpx-vp9", "libopus"),
    "birds": ("mp4", "libx264", "aac"),
    "quiet": ("mp4", "libx264", None),
}


@pytest.fixture(scope="module")
def ltx2_server(comfy_root, tmp_path_factory):
    """A ComfyUI server with this pack plus the test-only nodes, and the tiny LTX-2 files built."""
    from pipetrainer.tests.family_rows.common import require_model_class

    require_model_class("LTXAV")
    from pipetrainer.devkit.fixtures import _build_atomically
    from pipetrainer.devkit.fixtures_ltx2 import (
        GEMMA3_FILE,
        LTX2_CHECKPOINT_FILE,
        build_tiny_gemma3,
        build_tiny_ltx2_checkpoint,
    )

    for target, build in ((comfy_root / "models" / "checkpoints" / LTX2_CHECKPOINT_FILE, build_tiny_ltx2_checkpoint),
                          (comfy_root / "models" / "text_encoders" / GEMMA3_FILE, build_tiny_gemma3)):
        if not target.exists():
            _build_atomically(target, build)
    tmp = tmp_path_factory.mktemp("ltx2_server")
    srv = ComfyServer(comfy_root, tmp / "comfyui.log", extra_custom_nodes_args(TEST_NODES, tmp)).start()
    yield srv
    srv.stop()


def _audio_frames(stream, signal: np.ndarray):
    """``signal`` [2, n] float32 as frames of the encoder's frame size (planar float, as AAC and Opus take)."""
    import av

    size = stream.codec_context.frame_size or 1024
    for start in range(0, signal.shape[1], size):
        chunk = np.ascontiguousarray(signal[:, start:start + size])
        if chunk.shape[1] < size:
            chunk = np.pad(chunk, ((0, 0), (0, size - chunk.shape[1])))
        frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
        frame.sample_rate, frame.pts = stream.rate, start
        yield frame


def _write_dataset(folder: Path, seed: int, tag: str) -> None:
    """A square moving over a background, a chord of two sines per clip with sound; seeded by ``seed``, ``tag``
    in the captions, so every run's files and captions are new to the cache."""
    import av

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for name, (container, vcodec, acodec) in CLIPS.items():
        bg, fg = rng.integers(0, 256, 3, dtype=np.uint8), rng.integers(0, 256, 3, dtype=np.uint8)
        (folder / f"{name}.txt").write_text(f"a {name} clip of a moving square, {tag}\n", encoding="utf-8")
        with av.open(str(folder / f"{name}.{container}"), "w") as out:
            video = out.add_stream(vcodec, rate=FPS)
            video.width, video.height, video.pix_fmt = SIZE, SIZE, "yuv420p"
            sound = None
            if acodec:
                sound = out.add_stream(acodec, rate=48000)
                sound.layout = "stereo"
            for f in range(FRAMES):
                pixels = np.empty((SIZE, SIZE, 3), dtype=np.uint8)
                pixels[:] = bg
                x = (5 * f) % (SIZE - 16)
                pixels[SIZE // 2 - 8:SIZE // 2 + 8, x:x + 16] = fg
                out.mux(video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
            out.mux(video.encode())
            if sound is not None:
                t = np.arange(int(48000 * 0.6)) / 48000  # longer than the 0.36 s of video
                hz = rng.uniform(200, 900, 2)
                signal = np.stack([0.3 * np.sin(2 * np.pi * hz[0] * t), 0.3 * np.sin(2 * np.pi * hz[1] * t)])
                for frame in _audio_frames(sound, signal.astype(np.float32)):
                    out.mux(sound.encode(frame))
                out.mux(sound.encode())


def _tiny_workflow(name: str, folder: str, stages: int) -> dict:
    """The example workflow with the tiny files, a 128 px 9-frame dataset, 3 fp32 steps on ``stages`` pipeline stages
    (split by layers: by parameters, the tiny model's embeddings outweigh both blocks and the first stage would
    hold no LoRA target), and a 2-step 128 px 9-frame sample with sound."""
    from pipetrainer.devkit.fixtures_ltx2 import GEMMA3_FILE, LTX2_CHECKPOINT_FILE

    prompt = json.loads(WORKFLOW.read_text())
    assert prompt[TEXT]["class_type"] == "LTXAVTextEncoderLoader"
    prompt[TEXT] = {"class_type": "PipeTrainerTestTinyLTXAVTextEncoderLoader",
                    "inputs": {"text_encoder": GEMMA3_FILE, "ckpt_name": LTX2_CHECKPOINT_FILE}}
    prompt[CKPT]["inputs"]["ckpt_name"] = LTX2_CHECKPOINT_FILE
    prompt[AUDIO_VAE]["inputs"]["ckpt_name"] = LTX2_CHECKPOINT_FILE
    prompt[DATASET]["inputs"].update(folder=folder, resolution=SIZE, max_frames=FRAMES, video_fps=float(FPS))
    prompt[CACHE]["inputs"]["text_dtype"] = "fp32"
    prompt[LORA]["inputs"].update(rank=4, alpha=4.0)
    prompt[OPTIMIZER]["inputs"].update(learning_rate=1e-3, warmup_steps=0, weight_decay=0.0)
    prompt[TRAIN]["inputs"].update(lora_name=name, steps=3, save_every=0, training_dtype="fp32",
                                   pipeline_stages=stages, partition_method="uniform", frame_rate=float(FPS))
    prompt[LATENT]["inputs"].update(width=SIZE, height=SIZE, length=FRAMES)
    prompt[AUDIO_LATENT]["inputs"].update(frames_number=FRAMES, frame_rate=FPS)
    prompt[SCHEDULER]["inputs"]["steps"] = 2
    assert prompt[DECODE]["class_type"] == "VAEDecodeTiled"
    prompt[DECODE] = {"class_type": "VAEDecode", "inputs": {"samples": prompt[DECODE]["inputs"]["samples"],
                                                            "vae": prompt[DECODE]["inputs"]["vae"]}}
    prompt[SAVE]["inputs"].update(filename_prefix=name, fps=float(FPS))
    prompt[SAVE_AUDIO]["inputs"]["filename_prefix"] = name
    # The same sample from the base MODEL (the loader's): what the trained MODEL's sound must differ from.
    prompt[BASE_GUIDER] = {"class_type": "CFGGuider", "inputs": {**prompt[GUIDER]["inputs"], "model": [CKPT, 0]}}
    prompt["31"] = {"class_type": "SamplerCustomAdvanced", "inputs": {**prompt[SAMPLER]["inputs"],
                                                                      "guider": [BASE_GUIDER, 0]}}
    prompt["32"] = {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["31", 0]}}
    prompt["33"] = {"class_type": "LTXVAudioVAEDecode", "inputs": {"samples": ["32", 1], "audio_vae": [AUDIO_VAE, 0]}}
    prompt[SAVE_BASE_AUDIO] = {"class_type": "SaveAudio", "inputs": {"audio": ["33", 0],
                                                                     "filename_prefix": f"{name}_base"}}
    return prompt


def _report(entry: dict) -> str:
    return "\n".join(entry["outputs"][CACHE]["text"])


def _saved_audio(entry: dict, root: Path, node: str = SAVE_AUDIO) -> list[Path]:
    return [root / "output" / a.get("subfolder", "") / a["filename"]
            for a in entry["outputs"].get(node, {}).get("audio", []) if a.get("type") == "output"]


def _decoded_audio(path: Path) -> tuple[np.ndarray, int]:
    """``(samples [ch, n], rate)`` of a saved audio file, as PyAV decodes it."""
    import av

    with av.open(str(path)) as f:
        stream = f.streams.audio[0]
        rate, channels = stream.rate, stream.channels
        frames = [(fr.to_ndarray(), fr.format.is_planar) for fr in f.decode(stream)]
    return np.concatenate([a if planar else a.reshape(-1, channels).T for a, planar in frames], axis=1), rate


def _audio_vae(ckpt_path: Path):
    """The checkpoint's audio VAE as ``LTXVAudioVAELoader`` builds it."""
    import comfy.sd
    import comfy.utils

    sd, metadata = comfy.utils.load_torch_file(str(ckpt_path), return_metadata=True)
    sd = comfy.utils.state_dict_prefix_replace(sd, {"audio_vae.": "autoencoder.", "vocoder.": "vocoder."},
                                               filter_keys=True)
    return comfy.sd.VAE(sd=sd, metadata=metadata)


def _check_cached_sound(spec: dict, ckpt_path: Path) -> None:
    """Each cached item's audio latent: the clips with sound encode their own track, the silent clip (no audio
    stream) encoded silence of its kept span, the same the pack's encoder gives here for silence."""
    from pipetrainer.training.cache.audio_latent import audio_vae_of, encode_audio, silence
    from pipetrainer.training.cache.reader import read_entries
    from pipetrainer.training.data.audio import NO_TRACK, SOUND, read_clip_audio

    vae = audio_vae_of(_audio_vae(ckpt_path))
    latents = {}
    for item in spec["items"]:
        name = Path(item["source"]).stem
        latents[name] = read_entries(item["latent_file"], [item["latent_key"]])[item["latent_key"]]["audio_latent"]
        state = read_clip_audio(item["source"], 16000, 2, FRAMES, float(FPS)).state
        assert state == (SOUND if CLIPS[name][2] else NO_TRACK), (name, state)
    assert sorted(latents) == sorted(CLIPS)
    assert len({tuple(v.shape) for v in latents.values()}) == 1 and next(iter(latents.values())).shape[0] == 8
    quiet = encode_audio(vae, *silence(vae, FRAMES / FPS))
    assert torch.allclose(latents["quiet"], quiet, rtol=0, atol=1e-5 * quiet.abs().max().item())
    for name in ("talk", "song", "birds"):
        assert (latents[name] - quiet).abs().max() > 0.1 * quiet.abs().max(), name  # its own sound, not silence


def _loaded_by_comfyui(ckpt_path: Path, lora: dict) -> dict:
    """The patches ComfyUI's own LoRA loader makes of ``lora`` for the checkpoint's model (``comfy.lora``)."""
    import comfy.lora
    import comfy.sd

    model = comfy.sd.load_checkpoint_guess_config(str(ckpt_path), output_vae=False, output_clip=False)[0]
    return comfy.lora.load_lora(lora, comfy.lora.model_lora_keys_unet(model.model, {}))


@pytest.mark.slow
def test_ltx2_workflow_caches_sound_trains_on_one_and_two_stages_and_samples_with_sound(ltx2_server, comfy_root,
                                                                                       request):
    from pipetrainer.devkit.fixtures_ltx2 import LTX2_CHECKPOINT_FILE

    tag = uuid.uuid4().hex[:6]
    folder = f"pipetrainer_test_videos/ltx2_e2e_{tag}"
    _write_dataset(comfy_root / "input" / folder, seed=int(tag, 16), tag=tag)
    request.addfinalizer(lambda: shutil.rmtree(comfy_root / "input" / folder, ignore_errors=True))

    entries, loras, specs = {}, {}, {}
    for stages in (1, 2):
        name = f"ltx2_e2e_{tag}_{stages}stage"
        entry = ltx2_server.wait(ltx2_server.queue(_tiny_workflow(name, folder, stages)), timeout=900)
        assert history_error(entry) is None, ltx2_server.log_tail()
        entries[stages] = entry
        lora_path = comfy_root / "models" / "loras" / f"{name}.safetensors"
        loras[stages] = load_file(str(lora_path))

        # The run trained every step of the LTX2 family on this checkpoint's recipe.
        [run_dir] = sorted((comfy_root / "output" / "pipetrainer" / "runs").glob(f"{name}-*"))
        spec = json.loads((run_dir / "spec.json").read_text())
        assert spec["model"]["loader"] == "checkpoint" and spec["model"]["path"].endswith(LTX2_CHECKPOINT_FILE), spec
        assert [e["step"] for e in read_all(run_dir) if e["type"] == "step"] == [1, 2, 3]
        specs[stages] = spec

    # The cache: 4 clips, one 128x128x9 bucket, encoded once (the second graph reuses ComfyUI's cached node output).
    report = _report(entries[1])
    assert report.startswith("cached 4 latents, 4 texts; reused 0 latents, 0 texts; re-encoded 0 latents, 0 texts; "
                             "skipped 0 files"), report
    assert re.search(r"buckets: \d+x\d+x9 \(4\)", report), report
    assert "1 clip(s) have no sound track and train on encoded silence of their kept span: quiet" in report, report
    ckpt_path = comfy_root / "models" / "checkpoints" / LTX2_CHECKPOINT_FILE
    _check_cached_sound(specs[1], ckpt_path)
    assert specs[1]["items"] == specs[2]["items"]  # both runs trained on the same cache entries

    # 1 and 2 pipeline stages: the same LoRA, bit for bit, trained away from its zero start.
    assert loras[1].keys() == loras[2].keys() and loras[1]
    for key in loras[1]:
        assert torch.equal(loras[1][key], loras[2][key]), key
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in loras[1].items())

    # The LoRA maps key for key in ComfyUI's own loader: here, and in the server (the Train MODEL it sampled).
    modules = {k.removesuffix(".lora_A.weight") for k in loras[1] if k.endswith(".lora_A.weight")}
    assert modules and all(k.startswith("diffusion_model.transformer_blocks.") for k in modules), sorted(modules)[:3]
    assert any(".audio_" in k for k in modules) and any(".attn1." in k for k in modules)  # both streams trained
    patches = _loaded_by_comfyui(ckpt_path, loras[1])
    assert len(patches) == len(modules)
    assert "lora key not loaded" not in ltx2_server.log_path.read_text(errors="replace")

    # The sample of each graph: 9 frames at 128 px through the video VAE, and sound through the audio VAE.
    from PIL import Image

    sounds = {}
    for stages, entry in entries.items():
        [clip] = output_images(entry, comfy_root)
        assert clip.suffix == ".webp" and clip.exists()
        with Image.open(clip) as webp:
            assert webp.n_frames == FRAMES and webp.size == (SIZE, SIZE)
        [audio] = _saved_audio(entry, comfy_root)
        samples, rate = _decoded_audio(audio)
        assert samples.shape[0] == 2 and np.isfinite(samples).all() and np.abs(samples).max() > 0, (stages, audio)
        assert abs(samples.shape[1] / rate - FRAMES / FPS) < 0.05, (samples.shape, rate)  # as long as the clip
        sounds[stages] = samples
        [base_audio] = _saved_audio(entry, comfy_root, SAVE_BASE_AUDIO)
        base, _ = _decoded_audio(base_audio)
        assert base.shape == samples.shape and not np.array_equal(base, samples), stages  # the LoRA is in the sound
    assert np.array_equal(sounds[1], sounds[2])  # bitwise-equal LoRAs sample the same sound

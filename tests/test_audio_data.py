"""Audio in the data path (issue #25): a clip's own track read with PyAV, resampled, cut to the kept frames.

Every clip is written here with PyAV from known sines (fixed frequencies and phases, no randomness), so the
references are analytic: a resampled or cut track must be the same sine at the new rate and time. On the
current host the native-rate decode is also compared with ComfyUI's own audio loader.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from pipetrainer.training.cache.keys import audio_components, audio_key, change_reason, latent_key, text_key
from pipetrainer.training.data.audio import (
    NO_TRACK,
    SILENT,
    SOUND,
    AudioSpan,
    audio_preprocessing,
    first_frame_time,
    kept_frames_span,
    read_audio,
    read_clip_audio,
    track_digest,
    track_problem,
)
from pipetrainer.training.data.dataset import DatasetError, scan_dataset
from pipetrainer.training.data.resample import resample

SR = 44100
FPS = 24
LEFT_HZ, RIGHT_HZ = 440.0, 1000.0


def _tone(n: int, sr: int, hz: float, amp: float, t0: float = 0.0) -> np.ndarray:
    return (amp * np.sin(2 * np.pi * hz * (t0 + np.arange(n) / sr))).astype(np.float32)


def _stereo(n: int, sr: int = SR, left: float = LEFT_HZ, amp: float = 1.0) -> np.ndarray:
    return np.stack([_tone(n, sr, left, 0.5 * amp), _tone(n, sr, RIGHT_HZ, 0.25 * amp)])


def _audio_frames(stream, signal: np.ndarray, sr: int, pts0: int):
    """``signal`` ``[channels, n]`` as frames in the stream's sample format."""
    ctx = stream.codec_context
    size = ctx.frame_size or 1024
    layout = "stereo" if signal.shape[0] == 2 else "mono"
    for s in range(0, signal.shape[1], size):
        chunk = np.ascontiguousarray(signal[:, s:s + size])
        if ctx.format.name == "s16":
            data = (chunk.T.reshape(1, -1) * 32767).round().astype(np.int16)
        else:
            data = chunk
        frame = av.AudioFrame.from_ndarray(data, format=ctx.format.name, layout=layout)
        frame.sample_rate, frame.pts = sr, s + pts0
        yield frame


def write_clip(path: Path, seconds: float = 2.0, audio: str | None = "pcm_s16le", signal: np.ndarray | None = None,
               video_start: int = 0, audio_start: int = 0, shade: int = 0, sr: int = SR) -> Path:
    """A 64x64 mpeg4 clip at ``FPS`` with an optional stereo track at ``sr`` (``signal`` or the two sines);
    ``video_start`` (frames) and ``audio_start`` (samples) shift either stream on the file's timeline."""
    with av.open(str(path), "w") as out:
        video = out.add_stream("mpeg4", rate=FPS)
        video.width, video.height, video.pix_fmt = 64, 64, "yuv420p"
        sound = None
        if audio:
            sound = out.add_stream(audio, rate=sr)
            sound.layout = "stereo"
        for i in range(int(seconds * FPS)):
            frame = av.VideoFrame.from_ndarray(np.full((64, 64, 3), (shade + 7 * i) % 255, np.uint8), format="rgb24")
            frame.pts = video_start + i
            for packet in video.encode(frame):
                out.mux(packet)
        if sound is not None:
            signal = _stereo(int(seconds * sr), sr) if signal is None else signal
            for frame in _audio_frames(sound, signal, sr, audio_start):
                for packet in sound.encode(frame):
                    out.mux(packet)
            for packet in sound.encode():
                out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
    return path


def write_wav(path: Path, sr: int = 22050, hz: float = 300.0, seconds: float = 1.0) -> Path:
    with av.open(str(path), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=sr)
        stream.layout = "mono"
        for frame in _audio_frames(stream, _tone(int(seconds * sr), sr, hz, 0.5)[None], sr, 0):
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("audio_media")
    quiet = np.zeros((2, 2 * SR), np.float32)
    return {
        "pcm": write_clip(d / "pcm.mov"),  # lossless track: exact references
        "pcm_same_sound": write_clip(d / "pcm_same_sound.mov", shade=100),  # other picture, same track
        "pcm_other_tone": write_clip(d / "pcm_other_tone.mov", signal=_stereo(2 * SR, left=550.0)),
        "late_video": write_clip(d / "late_video.mov", video_start=6),  # picture starts at 0.25 s
        "late_audio": write_clip(d / "late_audio.mov", audio_start=SR // 4),  # sound starts at 0.25 s
        "aac": write_clip(d / "aac.mp4", audio="aac"),
        "aac_late_video": write_clip(d / "aac_late_video.mp4", audio="aac", video_start=6),
        "opus": write_clip(d / "opus.mkv", audio="libopus", seconds=1.0, sr=48000),
        "no_track": write_clip(d / "no_track.mp4", audio=None),
        "quiet": write_clip(d / "quiet.mp4", audio="aac", signal=quiet),
        "wav": write_wav(d / "voice.wav"),
    }


def _sine_error(samples: torch.Tensor, rate: int, hz: float, amp: float, t0: float, skip: int = 0) -> float:
    ref = _tone(samples.shape[-1], rate, hz, amp, t0)
    return float(np.abs(samples.numpy() - ref)[skip:len(ref) - skip].max())


# ---- decoding and resampling ---------------------------------------------------------------------------------


def test_a_whole_track_decodes_at_its_own_rate_and_length(media):
    got = read_audio(str(media["pcm"]), SR, 2)
    assert got.state == SOUND and got.sample_rate == SR and got.source_rate == SR and got.source_channels == 2
    assert got.samples.dtype == torch.float32 and got.samples.shape == (2, 2 * SR)
    assert _sine_error(got.samples[0], SR, LEFT_HZ, 0.5, 0.0) < 1e-4  # s16 rounding only
    assert _sine_error(got.samples[1], SR, RIGHT_HZ, 0.25, 0.0) < 1e-4


@pytest.mark.parametrize("rate", [16000, 48000])
def test_resampling_gives_the_same_sines_at_the_new_rate(media, rate):
    got = read_audio(str(media["pcm"]), rate, 2)
    assert got.sample_rate == rate and got.samples.shape == (2, math.ceil(2 * SR * rate / SR))
    edge = rate // 50  # the track's own ends: nothing beyond them to interpolate from
    assert _sine_error(got.samples[0], rate, LEFT_HZ, 0.5, 0.0, skip=edge) < 2e-3
    assert _sine_error(got.samples[1], rate, RIGHT_HZ, 0.25, 0.0, skip=edge) < 2e-3


def test_resampling_removes_what_the_new_rate_cannot_hold():
    """A 10 kHz tone has no place at 16 kHz (8 kHz Nyquist): band-limited resampling drops it, where
    picking samples would fold it to 6 kHz at full strength."""
    tone = torch.from_numpy(_tone(SR, SR, 10000.0, 0.5))[None]
    assert float(resample(tone, SR, 16000)[0, 400:-400].abs().max()) < 0.01
    assert resample(tone, SR, SR) is tone


def test_native_decode_matches_comfyui_own_audio_loader(comfy_root, media):
    """ComfyUI's LoadAudio reads with PyAV too (comfy_extras/nodes_audio.py ``load`` on current ComfyUI):
    the same samples, bit for bit, for a lossy track."""
    try:
        loader = importlib.import_module("comfy_extras.nodes_audio")
    except ImportError as exc:  # ComfyUI 0.3.75 imports torchaudio there, which the test venv lacks
        pytest.skip(f"comfy_extras.nodes_audio cannot be imported on this host: {exc}")
    if not hasattr(loader, "load"):
        pytest.skip("this ComfyUI has no module-level audio load function")
    theirs, rate = loader.load(str(media["aac"]))
    ours = read_audio(str(media["aac"]), rate, theirs.shape[0])
    assert ours.source_rate == rate
    torch.testing.assert_close(ours.samples, theirs.float(), rtol=0, atol=0)


def test_other_codecs_and_a_standalone_wav_read_the_same_way(media):
    opus = read_audio(str(media["opus"]), 16000, 2, AudioSpan(0.25, 0.5))
    assert opus.state == SOUND and opus.source_rate == 48000 and opus.samples.shape == (2, 8000)
    assert _sine_error(opus.samples[0], 16000, LEFT_HZ, 0.5, 0.25) < 0.05  # lossy, but in place

    wav = read_audio(str(media["wav"]), 16000, 2)  # mono 22.05 kHz file, stereo 16 kHz wanted
    assert wav.source_rate == 22050 and wav.source_channels == 1
    assert wav.samples.shape == (2, math.ceil(22050 * 16000 / 22050))
    torch.testing.assert_close(wav.samples[0], wav.samples[1])  # mono copied to both, as ComfyUI's LTX-2 VAE does
    assert _sine_error(wav.samples[0], 16000, 300.0, 0.5, 0.0, skip=320) < 2e-3
    mono = read_audio(str(media["pcm"]), SR, 1)
    torch.testing.assert_close(mono.samples[0], read_audio(str(media["pcm"]), SR, 2).samples.mean(0))


# ---- cutting to the kept frames --------------------------------------------------------------------------------


def _decoded_video_times(path: Path) -> list[float]:
    with av.open(str(path)) as container:
        return sorted(float(f.time) for f in container.decode(container.streams.video[0]) if f.time is not None)


@pytest.mark.parametrize("name", ["pcm", "late_video", "aac_late_video"])
def test_the_cut_covers_exactly_the_kept_frames(media, name):
    """load_video keeps frames at ``first + k / fps``; the audio is cut to ``[first + s / fps, + frames / fps)``,
    the sine in it at the phase of that time (one sample off would miss by 0.086 at 440 Hz, 16 kHz)."""
    path, fps, start_frame, frames = str(media[name]), 16.0, 4, 17
    first = _decoded_video_times(media[name])[0]
    assert first_frame_time(path) == first
    span = kept_frames_span(first, frames, fps, start_frame)
    assert span == AudioSpan(first + start_frame / fps, frames / fps)
    got = read_clip_audio(path, 16000, 2, frames=frames, fps=fps, start_frame=start_frame)
    assert got.state == SOUND and got.padded == 0
    assert abs(got.samples.shape[1] - frames / fps * 16000) <= 1
    lossy = name.startswith("aac")
    assert _sine_error(got.samples[0], 16000, LEFT_HZ, 0.5, span.start) < (0.05 if lossy else 2e-3)


def test_a_track_that_starts_late_is_zero_filled_and_counted(media):
    got = read_audio(str(media["late_audio"]), 16000, 2, AudioSpan(0.0, 1.0))
    assert got.state == SOUND and got.padded == 4000 and got.samples.shape == (2, 16000)
    assert float(got.samples[:, :3990].abs().max()) == 0.0
    assert _sine_error(got.samples[0, 4200:], 16000, LEFT_HZ, 0.5, 4200 / 16000 - 0.25) < 2e-3


def test_a_span_past_the_track_end_is_zero_filled(media):
    got = read_audio(str(media["pcm"]), 16000, 2, AudioSpan(1.5, 1.0))
    assert got.samples.shape == (2, 16000) and got.padded == 8000
    assert float(got.samples[:, 8010:].abs().max()) == 0.0


def test_kept_frames_need_sane_numbers():
    with pytest.raises(ValueError, match="frames >= 1"):
        kept_frames_span(0.0, 0, 16.0)


# ---- clips without sound --------------------------------------------------------------------------------------


def test_a_clip_without_a_track_or_with_a_silent_one_says_so(media):
    none = read_audio(str(media["no_track"]), 16000, 2, AudioSpan(0.0, 1.0))
    assert none.state == NO_TRACK and not none.has_sound and none.samples.shape == (2, 0)
    assert "no audio track" in none.note
    assert track_problem(str(media["no_track"])) == "the file has no audio track"
    assert track_problem(str(media["aac"])) is None
    quiet = read_audio(str(media["quiet"]), 16000, 2, AudioSpan(0.0, 1.0))
    assert quiet.state == SILENT and quiet.samples.shape == (2, 16000)
    assert track_digest(str(media["no_track"])) == ""


def _dataset(root: Path, media: dict[str, Path]) -> Path:
    from PIL import Image

    root.mkdir()
    for name in ("aac", "no_track"):
        (root / media[name].name).write_bytes(media[name].read_bytes())
        (root / f"{media[name].stem}.txt").write_text(f"a clip {name}")
    Image.new("RGB", (32, 32), (9, 9, 9)).save(root / "still.png")
    (root / "still.txt").write_text("a still")
    return root


def test_the_scan_reports_clips_without_sound_only_when_asked(tmp_path, media):
    folder = _dataset(tmp_path / "data", media)
    plain = scan_dataset(folder, 64)
    assert plain.audio == "off" and plain.without_audio == () and "sound" not in plain.report()
    optional = scan_dataset(folder, 64, audio="optional")
    assert len(optional.entries) == 3  # they still train, with the family's no-audio input
    assert optional.without_audio == ("no_track.mp4: the file has no audio track",)
    assert "1 clip(s) without sound train with the model's no-audio input: no_track.mp4" in optional.report()
    with pytest.raises(DatasetError, match=r"no_track\.mp4: the file has no audio track.*Give each clip an audio"):
        scan_dataset(folder, 64, audio="required")
    with pytest.raises(DatasetError, match="audio must be one of off, optional, required"):
        scan_dataset(folder, 64, audio="yes")


# ---- the cache key --------------------------------------------------------------------------------------------


def test_the_track_identity_follows_the_sound_not_the_picture(media):
    same = track_digest(str(media["pcm"]))
    assert same and same == track_digest(str(media["pcm"]))
    assert track_digest(str(media["pcm_same_sound"])) == same  # another picture, the same track
    assert track_digest(str(media["pcm_other_tone"])) != same


def test_the_audio_key_changes_with_the_track_the_preprocessing_and_the_encoder(media):
    span = kept_frames_span(0.0, 17, 16.0, 4)
    track = track_digest(str(media["pcm"]))
    prep = audio_preprocessing(16000, 2, span)
    encoder = {"weights": "abc", "dtype": "fp32"}
    key = audio_key(track, prep, encoder)
    assert key == audio_key(track_digest(str(media["pcm"])), audio_preprocessing(16000, 2, span), dict(encoder))
    assert audio_key(track_digest(str(media["pcm_other_tone"])), prep, encoder) != key
    assert audio_key(track, audio_preprocessing(48000, 2, span), encoder) != key
    assert audio_key(track, audio_preprocessing(16000, 1, span), encoder) != key
    assert audio_key(track, audio_preprocessing(16000, 2, kept_frames_span(0.0, 17, 16.0, 5)), encoder) != key
    assert audio_key(track, prep, {"weights": "abd", "dtype": "fp32"}) != key
    old = audio_components(track, prep, encoder)
    new = audio_components(track, audio_preprocessing(48000, 2, span), encoder)
    assert change_reason(old, new) == "audio preprocessing changed (rate 16000 -> 48000)"
    assert change_reason(old, audio_components("other", prep, encoder)) == "audio track changed"


def test_the_latent_and_text_keys_are_what_they_were():
    """Values computed with keys.py as it was before the audio key (git HEAD at the time): old caches keep being found."""
    assert latent_key("d" * 40, '{"frames": 1}', "vae") == "335203cbb543e07db409f931bc8cc2dcfbcd0db4"
    assert text_key("a cat", '"enc"') == "59c7650e247aca654583ac087cb5f872d945c700"


# ---- the LTX-2 audio VAE's input without torchaudio -------------------------------------------------------------


def _chirp(rate: int, seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return 0.5 * np.sin(2 * np.pi * 440 * t) + 0.1 * np.sin(2 * np.pi * 3000 * t * (1 + t))


def test_log_mel_matches_an_independent_implementation():
    """transformers' numpy audio_utils (its own STFT and Slaney filter bank) as the reference: the same
    settings as ComfyUI's LTX-2 AudioPreprocessor (16 kHz, n_fft 1024, hop 160, 64 mels, power 1, log floor 1e-5)."""
    audio_utils = pytest.importorskip("transformers.audio_utils")
    from pipetrainer.training.cache.audio_mel import log_mel, mel_filters

    rate, n_fft, hop, mels = 16000, 1024, 160, 64
    bank = audio_utils.mel_filter_bank(num_frequency_bins=n_fft // 2 + 1, num_mel_filters=mels, min_frequency=0.0,
                                       max_frequency=rate / 2, sampling_rate=rate, norm="slaney", mel_scale="slaney")
    np.testing.assert_allclose(mel_filters(rate, n_fft, mels).numpy(), bank, atol=1e-12)
    x = _chirp(rate)
    ref = audio_utils.spectrogram(x, audio_utils.window_function(n_fft, "hann", periodic=True), frame_length=n_fft,
                                  hop_length=hop, fft_length=n_fft, power=1.0, center=True, pad_mode="reflect",
                                  mel_filters=bank, mel_floor=1e-5, log_mel="log")
    ours = log_mel(torch.from_numpy(x)[None, None], rate, n_fft, hop, mels)
    assert ours.shape == (1, 1, rate // hop + 1, mels)
    np.testing.assert_allclose(ours[0, 0].numpy().T, ref, atol=1e-5)
    ours32 = log_mel(torch.from_numpy(x).float()[None, None].expand(2, 2, -1), rate, n_fft, hop, mels)
    np.testing.assert_allclose(ours32[1, 1].numpy().T, ref, atol=1e-2)  # float32: the log floor's neighbourhood


def test_the_ltx2_audio_autoencoder_encodes_the_mel_without_torchaudio(comfy_root, media):
    """ComfyUI's AudioVAE.encode builds its mel with torchaudio; the autoencoder behind it needs none. A clip
    read at the VAE's rate, its mel made here, goes through ComfyUI's CausalAudioAutoencoder (default LTX-2
    config, random weights: shapes and finiteness only). Where torchaudio is real, both mels must agree."""
    try:
        from comfy.ldm.lightricks.vae import audio_vae
        from comfy.ldm.lightricks.vae.causal_audio_autoencoder import CausalAudioAutoencoder
    except ImportError as exc:
        pytest.skip(f"this ComfyUI has no LTX-2 audio VAE: {exc}")
    import torchaudio
    from pipetrainer.training.cache.audio_mel import log_mel

    torch.manual_seed(0)
    ae = CausalAudioAutoencoder()
    for p in ae.parameters():
        torch.nn.init.normal_(p, std=0.02)
    clip = read_clip_audio(str(media["pcm"]), ae.sampling_rate, ae.encoder.in_channels, frames=17, fps=16.0)
    mel = log_mel(clip.samples[None], ae.sampling_rate, ae.n_fft, ae.mel_hop_length, ae.mel_bins)
    assert mel.shape == (1, 2, clip.samples.shape[1] // ae.mel_hop_length + 1, ae.mel_bins)
    with torch.no_grad():
        latent = ae.encode(mel)
    assert latent.shape[:2] == (1, 16) and latent.shape[3] == ae.mel_bins // 4 and torch.isfinite(latent).all()
    theirs = audio_vae.AudioPreprocessor(ae.sampling_rate, ae.mel_bins, ae.mel_hop_length, ae.n_fft)
    if str(getattr(torchaudio, "__version__", "")).endswith("stub"):
        with pytest.raises(RuntimeError, match="torchaudio stub"):
            theirs.waveform_to_mel(clip.samples[None], ae.sampling_rate, "cpu")
    else:
        torch.testing.assert_close(mel, theirs.waveform_to_mel(clip.samples[None], ae.sampling_rate, "cpu"),
                                   atol=1e-3, rtol=0)

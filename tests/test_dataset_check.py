"""The Dataset node's folder check: every problem of a folder in one message (one queue), the unreadable and
truncated files found by a header check beside the missing captions and unpaired references. Files are
real: written by Pillow and PyAV, then damaged the way a failed copy damages them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pipetrainer.training.data.dataset import DatasetError, scan_dataset
from pipetrainer.training.data.media_check import image_problem, video_problem


def _image(path: Path, fmt: str, caption: str | None = "a caption") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(path.name))
    Image.fromarray(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)).save(path, format=fmt)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def _cut(path: Path, keep: float = 0.6) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def _video(path: Path) -> Path:
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(4):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 40, dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    path.with_suffix(".txt").write_text("a clip", encoding="utf-8")
    return path


@pytest.mark.parametrize("fmt,ext", [("PNG", ".png"), ("JPEG", ".jpg"), ("WEBP", ".webp")])
def test_a_whole_image_passes_and_a_cut_one_is_named(fmt, ext, tmp_path):
    good = _image(tmp_path / f"good{ext}", fmt)
    assert image_problem(str(good)) is None
    cut = _cut(_image(tmp_path / f"cut{ext}", fmt))
    problem = image_problem(str(cut))
    assert problem and ("cut short" in problem or "unreadable" in problem), problem


@pytest.mark.parametrize("fmt,ext,pad", [("JPEG", ".jpg", 100), ("PNG", ".png", 20_000)])
def test_an_image_padded_after_its_end_still_passes(fmt, ext, pad, tmp_path):
    padded = _image(tmp_path / f"padded{ext}", fmt)
    padded.write_bytes(padded.read_bytes() + b"\x00" * pad)  # what `cp` of a shorter file over a longer leaves
    assert image_problem(str(padded)) is None


def test_a_text_file_named_png_and_an_empty_file_are_named(tmp_path):
    (tmp_path / "notes.png").write_text("not an image", encoding="utf-8")
    (tmp_path / "empty.jpg").write_bytes(b"")
    assert "not an image" in image_problem(str(tmp_path / "notes.png"))
    assert image_problem(str(tmp_path / "empty.jpg")) == "the file is empty"


def test_a_whole_video_passes_and_a_broken_one_is_named(tmp_path):
    assert video_problem(str(_video(tmp_path / "clip.mp4"))) is None
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom" + b"\x07" * 64)
    assert "unreadable" in (video_problem(str(tmp_path / "broken.mp4")) or "")


def test_one_queue_reports_every_problem_of_the_folder(tmp_path):
    """A missing caption, a truncated PNG, a file that is no image and an unpaired reference: one message."""
    data, control = tmp_path / "data", tmp_path / "control"
    for name in ("a", "b", "c"):
        _image(data / f"{name}.png", "PNG")
        _image(control / f"{name}.png", "PNG", caption=None)
    _image(data / "nocap.png", "PNG", caption=None)
    _cut(data / "b.png")
    (data / "c.png").write_bytes(b"GIF89a but not really")
    (control / "a.png").unlink()
    with pytest.raises(DatasetError) as info:
        scan_dataset(data, 64, missing_caption="error", control_folder=control)
    message = str(info.value)
    assert "1 file(s) in" in message and "have no caption" in message and "nocap.png" in message, message
    assert "(Also skipped, 2 file(s) that cannot be read:" in message, message
    assert "b.png: the PNG ends before its IEND chunk" in message and "c.png: not an image" in message, message
    assert "no reference image" in message and "a.png" in message, message


def test_unreadable_files_are_skipped_and_named_in_the_report(tmp_path):
    data = tmp_path / "data"
    _image(data / "a.png", "PNG")
    _image(data / "b.jpg", "JPEG")
    _video(data / "c.mp4")
    _cut(_image(data / "d.png", "PNG"))
    spec = scan_dataset(data, 64)
    assert [Path(e.path).name for e in spec.entries] == ["a.png", "b.jpg", "c.mp4"]
    assert spec.report().startswith("2 images and 1 videos in")
    assert "skipped 1 that cannot be read: d.png: the PNG ends before its IEND chunk" in spec.report()
    (data / "a.png").write_bytes(b"")
    (data / "b.jpg").write_bytes(b"")
    (data / "c.mp4").write_bytes(b"")
    with pytest.raises(DatasetError, match="No file in .* can be read: a.png: the file is empty"):
        scan_dataset(data, 64)

"""training/model/page_out.py: a load from memory-mapped weights gives back each module's file pages as it goes,
and nothing loaded changes."""

from __future__ import annotations

import mmap
import os

import torch
from pipetrainer.training.model.page_out import page_out, paged_out_as_loaded, whole_pages
from torch import nn

BLOCKS, WIDTH = 8, 512  # 8 blocks of 1 MiB (fp32)


def test_only_pages_wholly_inside_a_tensor_are_given_back():
    page = 4096
    assert whole_pages(4096, 8192, page) == (4096, 8192)
    assert whole_pages(4000, 8192, page) == (4096, 4096)  # both ends shared with neighbours
    assert whole_pages(10, 100, page) == (4096, 0)  # inside one page: nothing


def _mapped_file(tmp_path):
    """A file of the blocks' weights, mapped copy-on-write (as a safetensors file is), and its tensors."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(WIDTH, WIDTH, generator=g) for _ in range(BLOCKS)]
    path = tmp_path / "weights.bin"
    with open(path, "wb") as f:  # written back to disk, as a model file is: its cached pages are clean
        f.write(b"".join(w.numpy().tobytes() for w in weights))
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    flat = torch.frombuffer(mapped, dtype=torch.float32)
    state = {f"{i}.weight": flat[i * WIDTH * WIDTH:(i + 1) * WIDTH * WIDTH].view(WIDTH, WIDTH) for i in range(BLOCKS)}
    return path, mapped, state, weights


def _mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = fields[-1] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def _load(tmp_path, paged: bool) -> tuple[int, nn.Module, list[torch.Tensor]]:
    path, mapped, state, weights = _mapped_file(tmp_path / ("paged" if paged else "plain"))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(BLOCKS)))
    if paged:
        with paged_out_as_loaded(model):
            model.load_state_dict(state)
    else:
        model.load_state_dict(state)
    rss = _mapped_rss(path)  # the mapping is still alive here, as while a rank loads its stage
    del state
    return rss, model, weights


def test_a_load_keeps_about_one_module_of_file_pages_and_loads_the_same_weights(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "paged").mkdir()
    plain_rss, plain, weights = _load(tmp_path, paged=False)
    paged_rss, paged, _ = _load(tmp_path, paged=True)
    size = BLOCKS * WIDTH * WIDTH * 4
    assert plain_rss >= 0.9 * size  # without it every page read stays with the process
    assert paged_rss <= 0.1 * size, (paged_rss, size)
    for i in range(BLOCKS):
        assert torch.equal(paged[i].weight, weights[i]) and torch.equal(plain[i].weight, weights[i])


def test_page_out_leaves_memory_it_cannot_reclaim_as_it_was():
    t = torch.arange(3 * 4096, dtype=torch.float32)  # anonymous memory: never changed by a page-out
    assert page_out([t, t[::2], torch.empty(0)]) >= 0
    assert torch.equal(t, torch.arange(3 * 4096, dtype=torch.float32))


def test_comfyuis_own_loader_gives_back_the_file_pages_of_every_weight_and_loads_the_same_model(fixture_paths):
    """Through ``Load Diffusion Model (PipeTrainer)`` (ComfyUI's loader inside): the pages asked back cover
    nearly the whole file, and the model equals one loaded without it."""
    import comfy.sd
    import pipetrainer.training.model.page_out as page_out_module
    from pipetrainer.nodes.model_source import PipeTrainerLoadDiffusionModel

    asked: list[int] = []
    real = page_out_module.page_out

    def counting(tensors):
        n = real(tensors)
        asked.append(n)
        return n

    page_out_module.page_out = counting
    try:
        paged = PipeTrainerLoadDiffusionModel.execute(fixture_paths.mmdit.name, "default").result[0]
    finally:
        page_out_module.page_out = real
    size = fixture_paths.mmdit.stat().st_size
    assert sum(asked) >= 0.8 * size, (sum(asked), size)
    plain = comfy.sd.load_diffusion_model(str(fixture_paths.mmdit))
    ours, theirs = paged.model.diffusion_model.state_dict(), plain.model.diffusion_model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)

"""Reference videos decoded as ComfyUI's Load Video decodes them, for the Cache node to hand to the cache.

The cache (training/cache/reference_media.py) imports no ComfyUI server code; the node layer runs inside ComfyUI and
gives it ComfyUI's own decoder (``VideoFromFile``, what Load Video and Get Video Components give a graph), so a
reference video trains on the very frames the user's sampling graph conditions on.
"""

from __future__ import annotations

import torch


class LoadVideoReader:
    """``(frames [F, H, W, 3], frame rate)`` of a file, by ComfyUI's ``VideoFromFile``."""

    identity = "comfy VideoFromFile v1"

    def __call__(self, path: str) -> tuple[torch.Tensor, float]:
        from comfy_api.latest import InputImpl

        components = InputImpl.VideoFromFile(path).get_components()
        return components.images, float(components.frame_rate)

"""ComfyUI-PipeTrainer: LoRA training for diffusion models as ComfyUI nodes.

ComfyUI imports this file when it loads custom nodes. It must stay light: the training process
imports this package too (to reach ``training``), and it must not pull in ComfyUI's server there.
"""

WEB_DIRECTORY = None


async def comfy_entrypoint():
    """ComfyUI V3 entry point: the extension that lists our nodes (imported only when called)."""
    from .nodes.extension import PipeTrainerExtension

    return PipeTrainerExtension()

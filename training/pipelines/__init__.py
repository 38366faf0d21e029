"""One module per model family behind one small contract (``base``: the Protocol and the registry that
maps ComfyUI model classes to families), with the shared target rules (``targets``), family options
(``options``), the stage layers of a network several families run (``unet``: SD 1.x / 2.x and SDXL) and the
checks every family passes (``checks``).

May import ComfyUI's model code, torch, ``spec`` and ``objective``. A new family is one new module here;
no shared file changes.
"""

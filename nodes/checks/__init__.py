"""What the nodes check before a run starts: every problem of a setup in one message (``preflight``), the
``gpus`` input, how ComfyUI was launched (``launch``), what nodes between the loader and Train LoRA did
to the MODEL (``graph_patches``, ``stacked_loras``), and the memory plan of ``blocks_to_swap`` auto and what a preview needs beside it (``memory``).

Runs in the ComfyUI process: may import ComfyUI, ``nodes.run.paths`` and pure-Python ``training`` modules.
"""

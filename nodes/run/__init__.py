"""What the Train node does while its run goes: start, follow and stop the process tree (``run_process``),
the pre-started tree for the next run (``warm_pool``), what it tells the user (``run_messages``,
``progress_text``, ``loss_plot``, ``preview_sheet``), previews rendered by ComfyUI (``previews``), which
checkpoint to continue (``checkpoints``) and where a run writes (``paths``).

Runs in the ComfyUI process: may import ComfyUI and pure-Python ``training`` modules (``spec``,
``process.events``), never the ranks' code.
"""

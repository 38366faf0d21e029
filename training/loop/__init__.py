"""The training loop on one rank: the DeepSpeed pipeline engine over a family's stage layers (``engine``),
checkpoints and exact resume (``resume``), the collectives the loop calls (``collectives``), checks that a
run is learning (``health``) and TensorBoard files (``tensorboard_log``).

The top of the training process: may import every other sub-package; nothing but ``process.rank`` (and
tests) imports ``engine``.
"""

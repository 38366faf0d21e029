"""Offloading of frozen base weights, so a pipeline stage fits a GPU smaller than its share of the model.

``block_swap`` keeps the frozen weights of a stage's last N blocks in (pinned) host memory and brings
each block to the compute device only while it runs; ``stages`` counts the blocks each stage can swap,
so the engine and the Train node's preflight refuse an impossible ``blocks_to_swap`` with the same words;
``memory_plan`` (pure arithmetic, no torch) picks the fewest blocks to swap for ``blocks_to_swap`` auto;
``preview_memory`` (pure too) sets what a preview needs on ComfyUI's GPU beside what the plan leaves free.
"""

"""Data and micro-batches: scanning a dataset folder (``dataset``, ``dataset_masks``, ``captions``), the
reproducible micro-batches the pipeline consumes (``micro_batches``), and the extra sets mixed in or
held out (``regularization``, ``validation``).

``dataset``, ``dataset_masks`` and ``captions`` are pure Python (the node layer scans folders with them);
the rest may import torch, ``spec``, ``cache`` (reading), ``objective`` and ``pipelines.base``.
"""

"""The process tree of a run: the entry script started by file path, the supervisor, the ranks, the warm
(pre-started) processes, and how a death or a slow rank is explained; plus the event stream back to the node.

May import the rest of ``training`` (a rank runs the loop). ``events``, ``process_util``, ``cluster`` and
the supervisor side stay free of torch, DeepSpeed and PEFT at import: the node layer reads events, and a
supervisor must start fast; only ``rank`` and ``warm_rank`` load the heavy packages, when they run.
"""

"""What is optimised: noise levels drawn as the model samples (``timesteps``), the noisy input and the
family's target from ComfyUI's ``model_sampling`` (``loss``), and per-item loss scales (``loss_weighting``).

May import torch, ComfyUI's model code and ``spec``. Policy that differs by model belongs to the family
(``pipelines``) or to ``model_sampling``, never guessed here.
"""

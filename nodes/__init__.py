"""The node layer: thin ComfyUI nodes that validate inputs, build the run spec and follow the run.

Never imports deepspeed or peft: training happens in a separate process (see training/).
"""

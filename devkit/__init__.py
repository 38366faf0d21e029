"""Developer tooling: the reproducible ComfyUI host, tiny fixtures and the headless demo."""

"""``scripts/pt.py`` subcommands: host, fixtures, demo."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pt.py", description="ComfyUI-PipeTrainer developer commands")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("host", help="unpack/link the ComfyUI host (COMFYUI_PATH or .host/ComfyUI)")
    fx = sub.add_parser("fixtures", help="build the tiny models and the demo dataset")
    fx.add_argument("--flux", action="store_true", help="also build the 535 M-param Flux-min model")
    sub.add_parser("demo", help="run the example workflow headless and print the LoRA and image paths")
    sub.add_parser("ui-workflow", help="regenerate workflows/*.json (UI format) from the API-format twins")
    args = parser.parse_args(argv)
    from .host import ensure_host

    root = ensure_host()
    if args.command == "host":
        print(root)
        return 0
    if args.command == "fixtures":
        from ..training.comfy_env import use_comfyui
        from .fixtures import ensure_fixtures

        use_comfyui(root)
        print(ensure_fixtures(root, flux=args.flux))
        return 0
    if args.command == "ui-workflow":
        from .demo import write_ui_workflows

        return write_ui_workflows()
    from .demo import run_demo

    return run_demo()

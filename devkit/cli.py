"""``scripts/pt.py`` subcommands: host, fixtures, demo, ui-workflow, check-workflows, link-duplicates."""

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
    sub.add_parser("check-workflows", help="check workflows/api/*.json against this host's nodes (/object_info)")
    links = sub.add_parser("link-duplicates", help="hard-link the files two venvs hold byte for byte (one copy on disk)")
    links.add_argument("keep", help="the venv whose files stay")
    links.add_argument("other", help="the venv whose identical files become links to keep's")
    args = parser.parse_args(argv)
    if args.command == "link-duplicates":
        from pathlib import Path

        from .disk import link_identical_files

        print(link_identical_files(Path(args.keep), Path(args.other)).summary())
        return 0
    from .host import ensure_host

    root = ensure_host()
    if args.command == "host":
        print(root)
        return 0
    if args.command == "fixtures":
        from ..training.model.comfy_env import use_comfyui
        from .fixtures import ensure_fixtures

        use_comfyui(root)
        print(ensure_fixtures(root, flux=args.flux))
        return 0
    if args.command == "ui-workflow":
        from .demo import write_ui_workflows

        return write_ui_workflows()
    if args.command == "check-workflows":
        return check_workflows(root)
    from .demo import run_demo

    return run_demo()


def check_workflows(root) -> int:
    """Print every problem a host's ComfyUI would have with the example workflows (nodes, inputs, values)."""
    import json
    from pathlib import Path

    from .host import ComfyServer
    from .workflow_ui import api_problems

    pack = Path(__file__).resolve().parent.parent
    with ComfyServer(root, pack / ".host" / "check-workflows-server.log") as server:
        object_info = server.get("/object_info")
    failed = 0
    for api_file in sorted((pack / "workflows" / "api").glob("*.json")):
        problems = api_problems(json.loads(api_file.read_text()), object_info)
        failed += bool(problems)
        print(f"{api_file.stem}: {'ok' if not problems else ''}")
        for problem in problems:
            print(f"  {problem}")
    return 1 if failed else 0

"""bench/gpu.py's output: the JSON line of each case and the table printed at the end.

:func:`record` turns a case's :class:`Result` into its JSON line (tokens/s, MFU and HFU, the loss
difference to the precision's first case), :func:`emit` prints it and appends it to ``--json``, and
:func:`table` lays the lines out with ratios to the bf16 ``blocks_to_swap`` 0 case. Only the standard
library: nothing here touches torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from _gpu_cases import Result
from _gpu_measure import Flops
from _gpu_model import Settings


def record(result: Result, settings: Settings, flops: Flops | None, peak: float | None,
           reference: Result | None) -> dict:
    """The JSON line of one case; ``reference`` is the first case of the same precision, whose losses
    this one should repeat (block swap moves weights; it does not change the arithmetic)."""
    s = result.s_per_step
    line = {"bench": "gpu", "case": result.case.label, **asdict(result.case), "ok": result.ok, "error": result.error,
            "s_per_step": s, "step_s": result.step_s, "setup_s": round(result.setup_s, 3),
            "tokens_per_s": settings.tokens / s if s else None,
            "peak_vram_gib": result.peak_vram_gib, "reserved_vram_gib": result.reserved_vram_gib,
            "host_rss_gib": result.host_rss_gib, "pinned_gib": result.pinned, "block_loads": result.block_loads,
            "swap_pinned_gib": result.swap_host[0] if result.swap_host else None,
            "swap_weight_gib": result.swap_host[1] if result.swap_host else None,
            "losses": result.losses}
    if flops is not None:
        line["model_flops_per_step"] = flops.model
        line["forward_flops"] = asdict(flops)
        if s and peak:
            line["mfu"] = flops.model / (s * peak * 1e12)
            line["hfu"] = flops.hardware / (s * peak * 1e12)
    if reference is not None and reference is not result and reference.losses and result.losses:
        line["loss_reference"] = reference.case.label
        line["loss_max_rel_diff"] = loss_difference(result, reference)
    return line


def loss_difference(result: Result, reference: Result) -> float:
    """The largest relative difference between the two cases' losses, step by step."""
    pairs = list(zip(result.losses, reference.losses, strict=False))
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value is not None and base else "-"


def _num(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-"


def table(lines: list[dict], base: dict | None) -> str:
    """The cases as a table; × columns are ratios to ``base`` (the bf16 blocks_to_swap 0 case)."""
    head = (f"{'case':<26} {'s/step':>8} {'×':>5} {'tokens/s':>9} {'MFU':>6} {'VRAM GiB':>9} {'×':>5} "
            f"{'RSS GiB':>8} {'×':>5} {'pinned/weights GiB':>18}  {'loss first -> last':<20} status")
    rows = [head, "-" * len(head)]
    b = base or {}
    for r in lines:
        s, vram, rss, losses = r["s_per_step"], r["peak_vram_gib"], r["host_rss_gib"], r["losses"]
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        loss = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"
        status = "ok" if r["ok"] else "FAILED: " + r["error"]
        pinned = (f"{r['swap_pinned_gib']:.2f}/{r['swap_weight_gib']:.2f}"
                  if r.get("swap_weight_gib") is not None else "-")
        rows.append(f"{r['case']:<26} {_num(s, '.3f'):>8} {_ratio(s, b.get('s_per_step')):>5} "
                    f"{_num(r['tokens_per_s'], '.0f'):>9} {mfu:>6} {_num(vram, '.2f'):>9} "
                    f"{_ratio(vram, b.get('peak_vram_gib')):>5} {rss:>8.2f} {_ratio(rss, b.get('host_rss_gib')):>5} {pinned:>18}  "
                    f"{loss:<20} {status}")
    return "\n".join(rows)


def emit(line: dict, json_path: Path | None) -> dict:
    text = json.dumps(line)
    print(text, flush=True)
    if json_path is not None:
        with open(json_path, "a", encoding="utf-8") as f:
            f.write(text + "\n")
    return line

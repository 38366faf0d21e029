"""The picture the Train node shows while it runs: the loss curve, and under it the newest previews.

ComfyUI draws one progress picture per running node (``ProgressBar.update_absolute``'s preview), in
every frontend; the loss curve already uses it, so the previews share it instead of racing it. The
full-size files are in the run folder and in the node's outputs at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

from PIL import Image, ImageDraw

ROW_H = 200
LABEL_H = 16


def progress_sheet(curve: Image.Image, previews: Sequence[Image.Image], step: int | None) -> Image.Image:
    """``curve`` on top; the previews of ``step`` in one row under it, scaled to the curve's width."""
    if not previews:
        return curve
    width = curve.width
    scaled = [p.resize((max(1, round(p.width * ROW_H / p.height)), ROW_H)) for p in previews]
    total = sum(p.width for p in scaled) + 4 * (len(scaled) - 1)
    if total > width:  # shrink the row to fit
        factor = width / total
        scaled = [p.resize((max(1, int(p.width * factor)), max(1, int(ROW_H * factor)))) for p in scaled]
    row_h = max(p.height for p in scaled)
    sheet = Image.new("RGB", (width, curve.height + LABEL_H + row_h), "white")
    sheet.paste(curve.convert("RGB"), (0, 0))
    ImageDraw.Draw(sheet).text((4, curve.height + 2), f"previews, step {step}", fill="black")
    x = 0
    for p in scaled:
        sheet.paste(p.convert("RGB"), (x, curve.height + LABEL_H))
        x += p.width + 4
    return sheet

"""Quantize one float weight matrix into a WeightFormat's packed tensors.

Round-to-nearest (RTN) takes each row's (int8) or group's (int4/int6) full range. With `importance` (the mean
square of each input feature over calibration data, E[x_k^2]), the range is instead shrunk by the factor
from a small grid that minimizes the expected output error of that row or group,

    sum_k E[x_k^2] * (w_k - dequant(quant(w_k)))^2

which is what a matmul with those activations actually sees: clipping a few outlier weights buys a finer
step for all the others, and the weights that meet large activations count most (see docs/QUANTIZATION.md).
"""
from __future__ import annotations

import torch

from dflash2.quantization.formats import HALF_DTYPE, SCALE_DTYPE, WeightFormat, pack

# Shrink factors tried for each group (int4/int6) or row (int8) when calibrating; 1.0 is plain RTN.
CLIP_GRID = {4: [1.0 - 0.025 * i for i in range(17)], 6: [1.0 - 0.0125 * i for i in range(17)],
             8: [1.0 - 0.01 * i for i in range(11)]}
_ROW_CHUNK = 8192


def quantize(weight: torch.Tensor, fmt: WeightFormat, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """[N, K] float weight -> the format's tensors (see formats.py). Rows are processed in chunks."""
    if fmt.bits == 16:
        return {"weight": weight.to(HALF_DTYPE).contiguous()}
    weight = weight.float()
    if importance is not None:
        importance = importance.float().clamp_min(0) + 1e-8
    parts = [_quantize_rows(weight[i:i + _ROW_CHUNK], fmt, importance) for i in range(0, weight.shape[0], _ROW_CHUNK)]
    return {name: torch.cat([p[name] for p in parts]).contiguous() for name in parts[0]}


def _quantize_rows(weight: torch.Tensor, fmt: WeightFormat, importance: torch.Tensor | None) -> dict[str, torch.Tensor]:
    grid = CLIP_GRID[fmt.bits] if importance is not None else [1.0]
    if fmt.bits == 8:
        return _int8(weight, grid, importance)
    return _grouped(weight, fmt, grid, importance)


def _int8(weight: torch.Tensor, grid: list[float], importance: torch.Tensor | None) -> dict[str, torch.Tensor]:
    absmax = weight.abs().amax(dim=1).clamp_min(1e-8)
    best_err = best_q = best_scale = None
    for shrink in grid:
        scale = (absmax * shrink / 127).to(SCALE_DTYPE).float().clamp_min(1e-8)
        q = torch.round(weight / scale[:, None]).clamp(-127, 127)
        if len(grid) == 1:
            best_q, best_scale = q, scale
            break
        err = (((q * scale[:, None] - weight) ** 2) * importance).sum(dim=1)
        if best_err is None:
            best_err, best_q, best_scale = err, q, scale
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_q = torch.where(better[:, None], q, best_q)
        best_scale = torch.where(better, scale, best_scale)
    return {"qweight": best_q.to(torch.int8), "scales": best_scale.to(SCALE_DTYPE)}


def _grouped(weight: torch.Tensor, fmt: WeightFormat, grid: list[float],
             importance: torch.Tensor | None) -> dict[str, torch.Tensor]:
    n, k = weight.shape
    size = fmt.group_size
    maxq = (1 << fmt.bits) - 1
    w = weight.view(n, k // size, size)
    wmin = w.amin(dim=-1).clamp_max(0)
    wmax = w.amax(dim=-1).clamp_min(0)
    imp = importance.view(1, k // size, size) if importance is not None else None
    best_err = best = None
    for shrink in grid:
        scale, zero, q = _fit(w, wmin * shrink, wmax * shrink, maxq)
        if len(grid) == 1:
            best = (scale, zero, q)
            break
        err = (((q - zero[..., None]) * scale[..., None] - w) ** 2 * imp).sum(dim=-1)
        if best_err is None:
            best_err, best = err, (scale, zero, q)
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = (torch.where(better, scale, best[0]), torch.where(better, zero, best[1]),
                torch.where(better[..., None], q, best[2]))
    scale, zero, q = best
    return {"qweight": pack(q.view(n, k), fmt.bits), "scales": scale.to(SCALE_DTYPE),
            "zeros": zero.to(torch.uint8)}


def _fit(w: torch.Tensor, wmin: torch.Tensor, wmax: torch.Tensor, maxq: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric grid over [wmin, wmax] (which contains 0): scale (f16-exact), integer zero, codes."""
    scale = ((wmax - wmin) / maxq).to(SCALE_DTYPE).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-wmin / scale).clamp(0, maxq)
    q = torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], 0, maxq)
    return scale, zero, q

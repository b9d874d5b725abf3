"""Quantize one float weight matrix into a WeightFormat's packed tensors.

Round-to-nearest (RTN, no calibration): int8 takes each row's absolute maximum as 127 steps; int4/int6 span
each group's [min, max] with 2^bits - 1 steps (a float zero point, so no range is lost to rounding it).

Calibrated (given `importance`, the mean square of each input feature over calibration data, E[x_k^2]): for
every row (int8) or group (int4/int6), several candidate ranges are tried, the range shrunk by each factor of
a small grid; for each, the codes are fixed and the scale (and zero point) refitted by weighted least
squares; the candidate with the least expected output error wins:

    sum_k E[x_k^2] * (w_k - dequant(q_k))^2

which is what a matmul with those activations sees: the weights that meet large activations count most,
and clipping a few outliers buys a finer step for all the others (docs/QUANTIZATION.md; llama.cpp's
imatrix quantization weighs its error the same way).
"""
from __future__ import annotations

import torch

from dflash2.quantization.formats import HALF_DTYPE, SCALE_DTYPE, WeightFormat, pack

# Range shrink factors tried for each group (int4/int6) or row (int8) when calibrating.
CLIP_GRID = {4: [1.0 - 0.03 * i for i in range(10)], 6: [1.0 - 0.02 * i for i in range(6)],
             8: [1.0 - 0.015 * i for i in range(5)]}
_ROW_CHUNK = 4096


def quantize(weight: torch.Tensor, fmt: WeightFormat, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """[N, K] float weight -> the format's tensors (see formats.py). Rows are processed in chunks."""
    if fmt.bits == 16:
        return {"weight": weight.to(HALF_DTYPE).contiguous()}
    weight = weight.float()
    if importance is not None:
        importance = importance.float().clamp_min(0) + 1e-8
    quantize_rows = _int8 if fmt.bits == 8 else _grouped
    parts = [quantize_rows(weight[i:i + _ROW_CHUNK], fmt, importance)
             for i in range(0, weight.shape[0], _ROW_CHUNK)]
    return {name: torch.cat([p[name] for p in parts]).contiguous() for name in parts[0]}


def _int8(weight: torch.Tensor, fmt: WeightFormat, importance: torch.Tensor | None) -> dict[str, torch.Tensor]:
    absmax = weight.abs().amax(dim=1).clamp_min(1e-8)
    rtn_scale = (absmax / 127).to(SCALE_DTYPE).float().clamp_min(1e-8)
    if importance is None:
        return _int8_tensors(weight, rtn_scale)
    best_scale = rtn_scale  # the candidates start from round-to-nearest, so calibration never loses to it
    best_err = (((torch.round(weight / rtn_scale[:, None]).clamp(-127, 127) * rtn_scale[:, None] - weight) ** 2)
                * importance).sum(dim=1)
    for shrink in CLIP_GRID[8]:
        q = torch.round(weight / (absmax * shrink / 127)[:, None]).clamp(-127, 127)
        fitted = (importance * q * weight).sum(1) / (importance * q * q).sum(1).clamp_min(1e-12)
        scale = torch.where(fitted > 0, fitted, absmax / 127).to(SCALE_DTYPE).float().clamp_min(1e-8)
        q = torch.round(weight / scale[:, None]).clamp(-127, 127)
        err = (((q * scale[:, None] - weight) ** 2) * importance).sum(dim=1)
        best_scale = torch.where(err < best_err, scale, best_scale)
        best_err = torch.minimum(err, best_err)
    return _int8_tensors(weight, best_scale)


def _int8_tensors(weight: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    q = torch.round(weight / scale[:, None]).clamp(-127, 127)
    return {"qweight": q.to(torch.int8), "scales": scale.to(SCALE_DTYPE)}


def _grouped(weight: torch.Tensor, fmt: WeightFormat, importance: torch.Tensor | None) -> dict[str, torch.Tensor]:
    n, k = weight.shape
    size, maxq = fmt.group_size, (1 << fmt.bits) - 1
    w = weight.view(n, k // size, size)
    wmin, wmax = w.amin(dim=-1), w.amax(dim=-1)
    scale, zero = _stored((wmax - wmin) / maxq, wmin)
    if importance is None:
        return _grouped_tensors(w, scale, zero, maxq, fmt.bits)
    imp = importance.view(1, k // size, size).expand_as(w)
    best = [_error(w, imp, scale, zero, maxq), scale, zero]  # round-to-nearest is the first candidate
    for shrink in CLIP_GRID[fmt.bits]:
        middle, half = (wmax + wmin) / 2, (wmax - wmin) / 2 * shrink
        step = (2 * half / maxq).clamp_min(1e-10)
        q = torch.clamp(torch.round((w - (middle - half)[..., None]) / step[..., None]), 0, maxq)
        scale, offset = _weighted_fit(w, q, imp, step, middle - half)
        scale, zero = _stored(scale, offset)
        err = _error(w, imp, scale, zero, maxq)
        better = err < best[0]
        best = [torch.minimum(err, best[0]), torch.where(better, scale, best[1]), torch.where(better, zero, best[2])]
    return _grouped_tensors(w, best[1], best[2], maxq, fmt.bits)


def _error(w: torch.Tensor, imp: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    q = _codes(w, scale, zero, maxq)
    return ((((q - zero[..., None]) * scale[..., None]) - w) ** 2 * imp).sum(dim=-1)


def _weighted_fit(w: torch.Tensor, q: torch.Tensor, imp: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted least squares  w ~ scale * q + offset  per group, keeping the given fit where it degenerates."""
    a, b, c = (imp * q * q).sum(-1), (imp * q).sum(-1), imp.sum(-1)
    d, e = (imp * q * w).sum(-1), (imp * w).sum(-1)
    det = a * c - b * b
    ok = det.abs() > 1e-12 * (a * c).clamp_min(1e-30)
    fit_scale = (c * d - b * e) / torch.where(ok, det, torch.ones_like(det))
    fit_offset = (a * e - b * d) / torch.where(ok, det, torch.ones_like(det))
    ok = ok & (fit_scale > 0)
    return torch.where(ok, fit_scale, scale), torch.where(ok, fit_offset, offset)


def _stored(scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, offset of code 0) -> the f16 scale and f16 zero point as stored (w = (q - zero) * scale)."""
    scale = scale.to(SCALE_DTYPE).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = (-offset / scale).to(SCALE_DTYPE).float()
    return scale, zero


def _codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale[..., None] + zero[..., None]), 0, maxq)


def _grouped_tensors(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int, bits: int
                     ) -> dict[str, torch.Tensor]:
    n, groups, size = w.shape
    q = _codes(w, scale, zero, maxq)
    return {"qweight": pack(q.view(n, groups * size), bits), "scales": scale.to(SCALE_DTYPE),
            "zeros": zero.to(SCALE_DTYPE)}

"""fp16 / bf16 casts for ``DataParallelSGD(compression="fp16" | "bf16")``.

Half the bytes of float32, no residual: the cast rounds to nearest even.

Overflow. bfloat16 has float32's exponent range, so only fp16 can overflow:
finite values of magnitude 65520 and above become ``inf`` (65504 is fp16's
largest finite value). Two guards, both the caller's choice:

* ``scale``: multiply before the cast (in float32, one pass). Pass
  ``1 / world_size`` to divide before an all-reduce sum, so that the fp16 sum
  cannot overflow where the float32 mean would not (torch's
  ``fp16_compress_hook`` divides first for the same reason).
  :func:`from_half` divides by the same ``scale`` to undo it.
* ``saturate=True``: clamp finite values to the largest finite half value
  instead of letting them become ``inf``. Off by default on purpose: under
  mixed precision, ``torch.amp.GradScaler`` must see an overflowed gradient as
  ``inf`` to skip the step and lower its scale; saturating would hide it.
  ``inf`` and ``nan`` inputs stay as they are either way.

Pure tensor code, no state.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HALF_DTYPES", "from_half", "half_dtype", "to_half"]

HALF_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


def half_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Return the torch dtype for ``"fp16"``, ``"bf16"``, ``torch.float16`` or ``torch.bfloat16``.

    Raises:
        ValueError: For anything else.
    """
    if isinstance(dtype, torch.dtype) and dtype in HALF_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in HALF_DTYPES:
        return HALF_DTYPES[dtype]
    raise ValueError(f"dtype must be 'fp16' or 'bf16' (or torch.float16 / torch.bfloat16), got {dtype!r}")


def to_half(
    x: Tensor,
    dtype: str | torch.dtype = "fp16",
    *,
    scale: float = 1.0,
    saturate: bool = False,
    out: Tensor | None = None,
) -> Tensor:
    """Return ``x * scale`` cast to fp16 or bf16 (rounded to nearest even).

    Args:
        x: Floating tensor of any shape.
        dtype: ``"fp16"`` or ``"bf16"`` (or the torch dtypes).
        scale: Factor applied in float32 before the cast, e.g. ``1 / world_size``.
            Must be finite and > 0.
        saturate: Clamp finite values beyond the half type's range to its
            largest finite value instead of ``inf`` (see the module docstring
            for why this is off by default).
        out: Optional tensor of ``x``'s shape and the half dtype, written in place.

    Returns:
        The half tensor (``out`` when given).

    Raises:
        ValueError: If ``x`` is not floating point, ``dtype`` or ``scale`` is
            invalid, or ``out`` does not match.
    """
    target = half_dtype(dtype)
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor, got {x.dtype}")
    _check_scale(scale)
    if out is None:
        out = torch.empty(x.shape, dtype=target, device=x.device)
    elif out.dtype != target or out.shape != x.shape or out.device != x.device:
        raise ValueError(
            f"out must be a {target} tensor of shape {tuple(x.shape)} on {x.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if saturate:
        values = x.float() * scale if scale != 1.0 else x.float()
        limit = torch.finfo(target).max
        clamped = values.clamp(-limit, limit)  # nan stays nan
        out.copy_(torch.where(values.isinf(), values, clamped))
    elif scale != 1.0:
        torch.mul(x, scale, out=out)  # the product in float32 (or x's dtype), rounded once to half
    else:
        out.copy_(x)
    return out


def from_half(h: Tensor, *, scale: float = 1.0, out: Tensor | None = None) -> Tensor:
    """Return ``h / scale`` as float32: the inverse of :func:`to_half` with the same ``scale``.

    Args:
        h: Floating tensor (normally fp16 or bf16).
        scale: The ``scale`` given to :func:`to_half`; must be finite and > 0.
        out: Optional float32 tensor of ``h``'s shape, written in place.

    Returns:
        The float32 tensor (``out`` when given).

    Raises:
        ValueError: If ``h`` is not floating point, ``scale`` is invalid, or
            ``out`` does not match.
    """
    if not h.is_floating_point():
        raise ValueError(f"h must be a floating tensor, got {h.dtype}")
    _check_scale(scale)
    if out is None:
        out = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    elif out.dtype != torch.float32 or out.shape != h.shape or out.device != h.device:
        raise ValueError(
            f"out must be a float32 tensor of shape {tuple(h.shape)} on {h.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    out.copy_(h)
    if scale != 1.0:
        out.div_(scale)
    return out


def _check_scale(scale: float) -> None:
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < float("inf")):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}; use 1 / world_size to divide first")

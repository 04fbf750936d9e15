"""Validation of radii ε: one check and one message for every bound, attack and command.

A radius is a finite real number ``≥ 0`` (``> 0`` where a zero radius means
nothing, e.g. a list of radii to evaluate). :func:`check_eps` validates one
number, :func:`eps_per_sample` a scalar or per-sample ``(B,)`` radius and
returns it as a ``(B,)`` tensor, :func:`check_eps_list` a non-empty list.
A non-number (a string, a bool) is a ``TypeError``; a negative, NaN or
infinite radius or a wrong shape a ``ValueError`` (the CLI prints either as one
line).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def _bad(name: str, eps: object, positive: bool) -> ValueError:
    return ValueError(f"{name} must be finite and {'> 0' if positive else '>= 0'}, "
                      f"got {eps}")


def check_eps(eps: float | Tensor, *, positive: bool = False,
              name: str = "eps") -> float:
    """``eps`` as a float: a finite number ``≥ 0`` (``> 0`` with ``positive``).

    A one-element tensor or array counts as a number.

    Raises:
        TypeError: ``eps`` is not a number.
        ValueError: NaN, infinite, negative (or zero with ``positive``), or a
            tensor with more than one element.
    """
    if isinstance(eps, Tensor | np.ndarray):
        if (eps.numel() if isinstance(eps, Tensor) else eps.size) != 1:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(eps.shape)}")
        eps = eps.item()
    if isinstance(eps, bool | np.bool_) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(eps).__name__}")
    value = float(eps)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise _bad(name, eps, positive)
    return value


def eps_per_sample(eps: float | Tensor, B: int, dtype: torch.dtype,
                   device: torch.device | str) -> Tensor:
    """ε as a ``(B,)`` tensor from a number or a ``()``, ``(1,)``, ``(B,)`` tensor.

    Raises:
        TypeError: ``eps`` is neither a number nor a tensor.
        ValueError: an ε that :func:`check_eps` refuses, or a shape mismatch.
    """
    if not isinstance(eps, Tensor):
        return torch.full((B,), check_eps(eps), dtype=dtype, device=device)
    if eps.ndim > 1 or (eps.ndim == 1 and eps.shape[0] not in (1, B)):
        raise ValueError(f"eps must be a scalar or have shape ({B},), "
                         f"got {tuple(eps.shape)}")
    if eps.dtype == torch.bool or eps.is_complex():
        raise TypeError(f"eps must be a real tensor, got {eps.dtype}")
    if not bool(torch.isfinite(eps).all()) or bool((eps < 0).any()):
        raise _bad("eps", eps.tolist(), positive=False)
    return eps.to(dtype=dtype, device=device).expand(B).clone()


def check_eps_list(eps: Sequence[float], *, positive: bool = True,
                   name: str = "eps") -> np.ndarray:
    """A non-empty list of radii, each one :func:`check_eps` accepts: ``(K,)`` floats.

    Raises:
        ValueError: an empty list, or a radius :func:`check_eps` refuses.
    """
    values = np.array([check_eps(e, positive=positive, name=name) for e in eps],
                      dtype=float)
    if values.size == 0:
        raise ValueError(f"give at least one {name}")
    return values

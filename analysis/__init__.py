"""Analysis tools: PGD lower bounds and Jacobian spectra of token maps."""

from analysis.jacobian import (
    block_jacobian_sigma,
    full_jacobian,
    jacobian_l1_linf_estimate,
)
from analysis.pgd import pgd_deviation

__all__ = [
    "block_jacobian_sigma",
    "full_jacobian",
    "jacobian_l1_linf_estimate",
    "pgd_deviation",
]

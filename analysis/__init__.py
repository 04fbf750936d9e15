"""Analyses of ViTs: spectra, Jacobians, tightness of bounds, attacks, plots.

Public entry points (``__all__``): weight and Jacobian spectra
(:func:`weight_spectra`, :func:`jacobian_spectrum`, :func:`block_jacobian_sigma`),
tightness of the bounds against PGD (:func:`layer_tightness`,
:func:`network_tightness`), attacks (:func:`robust_accuracy`, :func:`perturb`,
:func:`pgd_deviation`) and the figures (``plot_*``, :func:`save_figure`).
Everything else is internal to its submodule.
"""

from lipvit._lazy import lazy_getattr

_PUBLIC = {
    "weight_spectra": ".spectrum",
    "jacobian_spectrum": ".spectrum",
    "block_jacobian_sigma": ".jacobian",
    "layer_tightness": ".tightness",
    "network_tightness": ".tightness",
    "robust_accuracy": ".attacks",
    "perturb": ".attacks",
    "pgd_deviation": ".pgd",
    "plot_certified_accuracy": ".plots",
    "plot_jacobian_violin": ".plots",
    "plot_spectra": ".plots",
    "plot_tightness": ".plots",
    "save_figure": ".plots",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)

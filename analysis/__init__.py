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
    "weight_spectra": "analysis.spectrum",
    "jacobian_spectrum": "analysis.spectrum",
    "block_jacobian_sigma": "analysis.jacobian",
    "layer_tightness": "analysis.tightness",
    "network_tightness": "analysis.tightness",
    "robust_accuracy": "analysis.attacks",
    "perturb": "analysis.attacks",
    "pgd_deviation": "analysis.pgd",
    "plot_certified_accuracy": "analysis.plots",
    "plot_jacobian_violin": "analysis.plots",
    "plot_spectra": "analysis.plots",
    "plot_tightness": "analysis.plots",
    "save_figure": "analysis.plots",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)

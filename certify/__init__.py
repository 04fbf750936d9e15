"""Certified bounds on the local sensitivity of ViTs, and certification.

Public entry points (``__all__``): :class:`Certifier` (a model's certifier for
one method: build once, then ``certify(x, y, eps)`` returns tensors), the
network bound and certification of a
batch (:func:`network_bound`, :func:`certify_samples`, :func:`certified_radius`,
:func:`is_certified`, :func:`margin`) and the per-layer attention bounds
(:func:`lofast_bound`, LoFAST Theorem 1; :func:`specformer_bound`, SpecFormer
Theorem 4.2), and the first-order-exact network certificate
(:func:`taylor_bound`, docs/taylor.md). Certification runs in float64
whatever the model's dtype. Everything else is internal to its submodule.
"""

from lipvit._lazy import lazy_getattr

_PUBLIC = {
    "Certifier": ".certifier",
    "Certified": ".certifier",
    "NetworkBound": ".lofast.network",
    "network_bound": ".lofast.network",
    "CertifyReport": ".evaluate",
    "certify_samples": ".evaluate",
    "certified_radius": ".certification",
    "is_certified": ".certification",
    "margin": ".certification",
    "lofast_bound": ".lofast.layer",
    "specformer_bound": ".specformer",
    "TaylorBound": ".taylor.certificate",
    "taylor_bound": ".taylor.certificate",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)

"""The certification methods' names, kinds and the architectures each bounds.

Methods: ``lofast`` (exact ζ and ‖M_h‖, every number an upper bound),
``lofast-fast`` (power-iteration estimates: **not** a certificate),
``specformer`` (SpecFormer Thm 4.2 per attention layer), ``crown``
(auto_LiRPA CROWN on the whole network), ``alpha-crown`` (CROWN, then
auto_LiRPA's optimised ReLU slopes for the margins), ``cascade`` (``lofast``
first, CROWN only on the correctly classified samples ``lofast`` left
uncertified), ``taylor`` (first-order-exact margins with certified remainders,
:mod:`lipvit.certify.taylor.certificate`, docs/taylor.md), ``cascade-taylor``
(``taylor`` first, CROWN on the rest), ``global``, ``ball`` and ``margin`` (the
hybrid ViT's and CaiT's proven constants: global, over the ε-ball, following
the margin; docs/math.md §9–§11) and ``smoothing`` (Cohen et al.'s randomized
smoothing, :mod:`lipvit.certify.smoothing`: a **probabilistic** certificate of
the smoothed classifier, not of the network).

Every result carries a ``guarantee``: ``"deterministic"`` (a proof for the
network itself on the whole ball), ``"estimate"`` (``lofast-fast``: no
guarantee) or ``"probabilistic"`` (``smoothing``)."""

from __future__ import annotations

from collections.abc import Sequence

from lipvit.certify.attention import bound_weights
from lipvit.certify.global_bound import check_global
from lipvit.certify.lofast.network import METHODS as BOUND_METHODS
from lipvit.certify.lofast.network import check_dot_attention
from lipvit.certify.smoothing import GUARANTEE, SmoothingConfig
from lipvit.certify.taylor.forward import check_supported

from lipvit.errors import UnsupportedModelError

ALL_METHODS: tuple[str, ...] = (*BOUND_METHODS, "taylor", "crown", "alpha-crown",
                                "cascade", "cascade-taylor", "global", "ball",
                                "margin", "smoothing")
PROVEN_METHODS = ("global", "ball", "margin")
"""The methods of the architectures whose every map has a proven constant."""
ANY_ARCH = frozenset({*PROVEN_METHODS, "smoothing"})
"""The methods that do not bound lipvit's ViT architecture layer by layer
(``global``, ``ball``, ``margin``: the hybrid ViT's and CaiT's constants;
``smoothing``: any classifier)."""
CASCADES = {"cascade": "lofast", "cascade-taylor": "taylor"}
"""Each cascade: its first method; CROWN runs on what that left uncertified."""
LIRPA_METHODS = {"crown": "CROWN", "alpha-crown": "alpha-CROWN"}
"""The auto_LiRPA methods: each name's bound method in
:mod:`lipvit.certify.crown.bounds`."""
RADIUS_METHODS = frozenset(ALL_METHODS) - set(LIRPA_METHODS) - set(CASCADES)
"""The methods that give each point a certified radius (CROWN certifies one ε
at a time)."""


def guarantee_of(method: str) -> str:
    """The kind of guarantee a method's results give (see the module note)."""
    if method == "smoothing":
        return GUARANTEE
    return "estimate" if method == "lofast-fast" else "deterministic"


def check_method_names(methods: Sequence[str]) -> None:
    """Refuse an unknown method name (:class:`ValueError`, one line)."""
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise ValueError(
            f"unknown method {unknown[0]!r}; choose from {', '.join(ALL_METHODS)}")
    if not methods:
        raise ValueError("give at least one method")


def check_smoothing_settings(methods: Sequence[str], smoothing) -> None:
    """Refuse ``smoothing`` without its :class:`SmoothingConfig` (one line)."""
    if "smoothing" in methods and not isinstance(smoothing, SmoothingConfig):
        raise ValueError("smoothing needs its settings: pass smoothing="
                         "SmoothingConfig(sigma=...)")


def check_methods(model, methods: Sequence[str]) -> None:
    """Refuse, in one line (:class:`UnsupportedModelError`), a method that cannot
    bound ``model``'s architecture: ``global``, ``ball`` and ``margin`` need
    proven constants (the hybrid ViT, CaiT), ``smoothing`` takes any
    classifier, and every other method bounds lipvit's ``ViT`` only."""
    if any(m in PROVEN_METHODS for m in methods):
        check_global(model)
    arch = getattr(model.config, "arch", "vit")
    if arch != "vit":
        other = [m for m in methods if m not in ANY_ARCH]
        if other:
            raise UnsupportedModelError(
                f"{other[0]} bounds lipvit's ViT architecture; this model "
                f"(arch {arch!r}) is certified by its proven constants: use "
                "--method margin, ball or global"
            )


def taylor_unsupported(model) -> str | None:
    """Why ``taylor`` cannot bound ``model`` (one line), or None where it can."""
    try:
        check_supported(model)
        check_dot_attention(model, "taylor")
    except UnsupportedModelError as err:
        return str(err)
    return None


DEFAULT_METHODS = {"vit": "taylor", "hybrid": "ball", "cait": "margin"}
"""A ``certify`` without ``--method``, per architecture: the best sound method
each supports at its speed (``taylor``: first-order exact; ``ball``: the local
constants over the ε-ball, never weaker than ``global``; ``margin``: never
weaker than ``ball``, and on a CaiT whose class attention looks at the image
it certifies several times more, at about 6× ``ball``'s time; on the hybrid it
gains nothing over ``ball``). A ViT that taylor cannot bound falls back to
``lofast``, with a one-line note."""


def default_method(model) -> tuple[str, str | None]:
    """The method of a ``certify`` without ``--method`` (:data:`DEFAULT_METHODS`)
    and the one-line note that says why, where it is not the architecture's
    first choice.

    Raises:
        UnsupportedModelError: lofast cannot bound the model either (its reason).
    """
    arch = getattr(model.config, "arch", "vit")
    if arch != "vit":
        return DEFAULT_METHODS[arch], None
    why = taylor_unsupported(model)
    if why is None:
        return DEFAULT_METHODS[arch], None
    check_dot_attention(model, "the lofast network bound")
    for block in model.blocks:
        bound_weights(block.attn)  # refuses query/key biases
    return "lofast", (f"note: taylor cannot bound this model ({why}); certifying "
                      "with lofast")

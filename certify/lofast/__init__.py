"""LoFAST: local sensitivity bounds of dot-product attention and their
composition through a whole ViT (Havens et al.; docs/math.md §2–§4).

:mod:`.layer` bounds one attention layer (Theorem 1: the key sensitivity ζ,
Lemma 2's ``‖M_h(X)‖``, the δ2 terms); :mod:`.structured` certifies ζ and
``‖M_h(X)‖`` at sizes where the dense Gram matrices do not fit
(docs/structured-certificates.md); :mod:`.network` composes a layer bound
(LoFAST's, or SpecFormer's from :mod:`lipvit.certify.specformer`) with the
other layers' local Lipschitz constants (:mod:`lipvit.certify.local`) into
``δ_out``, the methods ``lofast``, ``lofast-fast`` and ``specformer``. Tests:
tests/test_lofast.py, tests/test_structured.py, tests/test_certify.py.
"""

"""CROWN and alpha-CROWN bounds of a ViT through auto_LiRPA (optional).

:mod:`.lirpa_compat` imports auto_LiRPA 0.3 on today's torch and numpy;
:mod:`.verifiable` rewrites a :class:`lipvit.ViT` with operators a
bound-propagation verifier handles; :mod:`.relaxations` gives the standard
family's GELU and LayerNorm their sound linear relaxations (docs/certificates.md);
:mod:`.bounds` runs CROWN over an ℓ2 ball for the margins, the logits and
one layer's output (the methods ``crown`` and ``alpha-crown``). Tests:
tests/test_crown.py, tests/test_crown_standard.py, tests/test_alpha_crown.py.
"""

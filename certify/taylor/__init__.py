"""``taylor``: the first-order-exact network certificate (docs/taylor.md).

The margin's drop over the ε-ball is bounded by its exact gradient times ε
plus the remainders of the network's nonlinear *sites*, propagated through
the clean point's Jacobians. :mod:`.certificate` assembles it
(:func:`~.certificate.taylor_bound`); :mod:`.forward` is the site-level
forward pass, :mod:`.sites` the margins' site gradients and the sub-block
norms, :mod:`.linearized` the clean point's Jacobian applied to tangents,
:mod:`.jacobian_norms` the streamed norms from the image, :mod:`.remainders`
each site's remainder bound, :mod:`.symbols` the ReLU flips carried exactly,
:mod:`.subblock` and :mod:`.softmax_norm` the attention sub-block's norm,
:mod:`.second_order`, :mod:`.jets` and :mod:`.margin_jets` the second-order
terms of a standard ViT. Proofs: docs/taylor.md (section numbers in every
docstring); tests against brute force and PGD: tests/test_taylor.py,
tests/test_symbols.py, tests/test_tangents.py, tests/test_jets.py.
"""

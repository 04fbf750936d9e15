"""The ``margin`` certificate (this package is ``follow``: the name ``margin`` is
:func:`lipvit.certify.margin`, the logit margin): the margin's exact gradient
at the point and a proven bound on how far it can turn over the ε-ball, for
the lipschitz family's hybrid ViT and CaiT, cascaded with ``ball``
(docs/math.md §11).

:mod:`.variation` bounds, per kind of map (MaxMin, self-attention, class
attention), how far the margin's gradient through it can change on a ball;
:mod:`.network` composes them with ``ball``'s radii and certifies. Tests:
tests/test_margin.py.
"""

"""The ``ball`` certificate: local Lipschitz constants of attention over the
ε-ball, composed with the proven constants of the other maps, for the
lipschitz family's hybrid ViT and CaiT (docs/math.md §10).

:mod:`.attention` bounds one attention map on a Frobenius ball around its
clean input (self-attention, eq. 10.2; class attention, eq. 10.5);
:mod:`.network` composes them through the model and certifies. Never weaker
than ``global`` (each local constant is capped by its global one). Tests:
tests/test_ball.py.
"""

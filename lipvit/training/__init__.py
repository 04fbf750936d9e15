"""The trainer, one module per job; :mod:`lipvit.train` re-exports its public names.

- :mod:`~lipvit.training.config`: :class:`TrainConfig` and the defaults per
  family, dataset and architecture (:func:`train_config_for`).
- :mod:`~lipvit.training.loop`: :func:`train` and :func:`train_step`.
- :mod:`~lipvit.training.losses`: the margin cross-entropy.
- :mod:`~lipvit.training.optim`: parameter groups and the learning-rate schedule.
- :mod:`~lipvit.training.adversarial`: PGD for adversarial training.
- :mod:`~lipvit.training.metrics`: test accuracy and exact σ_max per head.
- :mod:`~lipvit.training.device`: ranks under ``torchrun``, determinism, autocast.
- :mod:`~lipvit.training.resume`: RNG states and resuming from a checkpoint.
- :mod:`~lipvit.training.summary`: the per-epoch log and the JSON summary.
"""

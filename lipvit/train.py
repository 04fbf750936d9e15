"""The trainer: whole dataset on the device, MSVP penalty, PGD adversarial training.

Shapes: ``B`` batch, ``C`` channels, ``S`` image side, ``L`` layers, ``H`` heads.

One training step (SpecFormer eq. 11/14, docs/math.md §4)::

    J = CE(s · f(x̃), y)
        + Σ_layers Σ_heads [λ_q σ²(W_q[h]) + λ_k σ²(W_k[h]) + λ_v σ²(W_v[h])]

with ``x̃`` the augmented (and, with ``adv_train``, PGD-perturbed) batch and
``s`` the loss scale (:attr:`TrainConfig.loss_scale`); with ``cert_eps`` the
cross-entropy sees the logits raised by :mod:`lipvit.certified_training`. The
data never leave the device: batches are rows of one resident tensor picked by a
device permutation, augmented by :func:`lipvit.data.augment`. The learning rate
follows a linear warm-up then a cosine decay, per step. Autocast to bf16 on
CUDA. A checkpoint is written atomically at the end of every epoch (model,
optimizer, MSVP buffers, RNG states, epoch), so ``resume=True`` continues an
interrupted run. With ``torchrun`` (``WORLD_SIZE > 1``) the model is wrapped in
DistributedDataParallel, every rank takes its share of each batch and only rank
0 writes files and logs.

The code: the package :mod:`lipvit.training`, one module per job (re-exported here).
"""

from lipvit.runtime import cpu_threads, resolve_device
from lipvit.training.adversarial import pgd_attack
from lipvit.training.config import (
    ARCH_DEFAULTS,
    DATASET_DEFAULTS,
    FAMILY_DEFAULTS,
    AdvTrain,
    Device,
    Optimizer,
    TrainConfig,
    train_config_for,
)
from lipvit.training.device import autocast_for
from lipvit.training.loop import Logger, train, train_step
from lipvit.training.losses import margin_cross_entropy
from lipvit.training.metrics import evaluate, head_sigmas, sigma_summary
from lipvit.training.optim import lr_at
from lipvit.training.summary import EpochLog, summary_path

__all__ = [
    "ARCH_DEFAULTS",
    "DATASET_DEFAULTS",
    "FAMILY_DEFAULTS",
    "AdvTrain",
    "Device",
    "EpochLog",
    "Logger",
    "Optimizer",
    "TrainConfig",
    "autocast_for",
    "cpu_threads",
    "evaluate",
    "head_sigmas",
    "lr_at",
    "margin_cross_entropy",
    "pgd_attack",
    "resolve_device",
    "sigma_summary",
    "summary_path",
    "train",
    "train_config_for",
    "train_step",
]

"""lipvit: train Vision Transformers with spectral penalties; certify robustness.

Public entry points (``__all__``): models and presets, checkpoints (lipvit's own
and imported ``transformers`` / timm-layout ViTs), datasets and training. The
bounds live in :mod:`certify`, the analyses in :mod:`analysis`.
"""

from lipvit._lazy import lazy_getattr

__version__ = "0.1.0"

_PUBLIC = {
    "PRESETS": ".config",
    "ViTConfig": ".config",
    "preset": ".config",
    "ViT": ".model",
    "Certifier": ".certify.certifier",
    "Certified": ".certify.certifier",
    "ablate_attention": ".ablation",
    "Checkpoint": ".checkpoint",
    "load_checkpoint": ".checkpoint",
    "save_checkpoint": ".checkpoint",
    "vit_from_hf": ".interop",
    "vit_from_timm": ".interop",
    "load_timm": ".interop",
    "save_hf": ".interop",
    "save_timm": ".interop",
    "Dataset": ".data",
    "load_dataset": ".data",
    "TrainConfig": ".train",
    "train": ".train",
    "train_config_for": ".train",
}

__all__ = sorted([*_PUBLIC, "__version__"])
__getattr__ = lazy_getattr(__name__, _PUBLIC)

"""lipvit: train Vision Transformers with spectral penalties; certify robustness.

Public entry points (``__all__``): models and presets, checkpoints (lipvit's own
and imported ``transformers`` / timm-layout ViTs), datasets and training. The
bounds live in :mod:`certify`, the analyses in :mod:`analysis`.
"""

from lipvit._lazy import lazy_getattr

__version__ = "0.1.0"

_PUBLIC = {
    "PRESETS": "lipvit.config",
    "ViTConfig": "lipvit.config",
    "preset": "lipvit.config",
    "ViT": "lipvit.model",
    "Checkpoint": "lipvit.checkpoint",
    "load_checkpoint": "lipvit.checkpoint",
    "save_checkpoint": "lipvit.checkpoint",
    "vit_from_hf": "lipvit.interop",
    "vit_from_timm": "lipvit.interop",
    "load_timm": "lipvit.interop",
    "save_hf": "lipvit.interop",
    "save_timm": "lipvit.interop",
    "Dataset": "lipvit.data",
    "load_dataset": "lipvit.data",
    "TrainConfig": "lipvit.train",
    "train": "lipvit.train",
    "train_config_for": "lipvit.train",
}

__all__ = sorted([*_PUBLIC, "__version__"])
__getattr__ = lazy_getattr(__name__, _PUBLIC)

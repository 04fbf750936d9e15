"""lipvit: train Vision Transformers with spectral penalties; certify robustness."""

from lipvit.config import PRESETS, ViTConfig, preset
from lipvit.model import Attention, HeadBiases, HeadWeights, ViT

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "Attention",
    "HeadBiases",
    "HeadWeights",
    "ViT",
    "ViTConfig",
    "__version__",
    "preset",
]

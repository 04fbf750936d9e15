"""Model configuration and named presets.

Letters used in shape comments across lipvit: ``B`` batch, ``C`` image channels,
``N`` tokens (patches + class token), ``D`` width (``embed_dim``), ``H`` heads,
``d`` head width ``D / H``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

Family = Literal["standard", "lipschitz"]
AttnProject = Literal["frobenius", "token"]
AttentionKind = Literal["dot", "l2", "lipnorm", "scsa", "conv"]
Arch = Literal["vit", "hybrid", "cait"]
ARCHS: tuple[str, ...] = ("vit", "hybrid", "cait")
ATTENTIONS: tuple[str, ...] = ("dot", "l2", "lipnorm", "scsa", "conv")


@dataclass(frozen=True)
class ViTConfig:
    """Architecture of a :class:`lipvit.model.ViT`.

    Attributes:
        image_size: side of the square input image.
        in_chans: image channels ``C``.
        num_classes: classifier outputs.
        patch_size: side of a square patch; must divide ``image_size``.
        embed_dim: token width ``D``.
        depth: number of transformer blocks.
        num_heads: attention heads ``H``; must divide ``embed_dim``.
        mlp_ratio: hidden width of the feed-forward block over ``D``.
        family: ``"standard"`` (LayerNorm, GELU MLP: the SpecFormer setting) or
            ``"lipschitz"`` (LoFAST §5.2: LayerProject, SLL feed-forward,
            1-Lipschitz patch embedding and head, capped ``‖W_v‖``, ``‖W_o‖``).
        qkv_bias: biases on q, k, v (standard family only; LoFAST's bounds need
            bias-free q and k).
        attn_project: lipschitz family, projection before each attention:
            ``"frobenius"`` projects the whole token matrix onto the Frobenius
            ball of radius ``attn_radius`` (LoFAST's code); ``"token"`` projects
            every token onto the ball of radius ``attn_radius``.
        attn_radius: radius of that projection (LoFAST: 1).
        v_cap: lipschitz family, bound on every head's ``‖W_v[h]‖`` (exact).
        o_cap: lipschitz family, bound on every head's ``‖W_o[h]‖`` (exact).
        norm_eps: the LayerNorms' variance epsilon (standard family; torch's
            default 1e-5, timm uses 1e-6 and transformers 1e-12).
        mean: per-channel normalisation mean applied inside the model (empty:
            0.5 for every channel).
        std: per-channel normalisation standard deviation (empty: 0.5 each).
        attention: token mixing of every block (:mod:`lipvit.attention`):
            ``"dot"`` softmax(q kᵀ/√d) (timm, SpecFormer), ``"l2"`` L2
            self-attention with tied ``W_q = W_k`` (Kim et al. 2021, L2Former),
            ``"lipnorm"`` dot product with LipschitzNorm before the softmax
            (Dasoulas et al. 2021, LNFormer), ``"scsa"`` scaled cosine-similarity
            attention (Qi et al. 2023, LipsFormer), ``"conv"`` a 1-D convolution
            over the tokens per head group (CoViT, Cauchy-problem paper §5; the
            class token is then replaced by average pooling). Variants other
            than ``"dot"`` exist in the standard family only. Checkpoints
            written before this field existed load as ``"dot"``.
        conv_kernel: ``"conv"`` only: odd kernel size of every head's 1-D
            convolution (CoViT "K3": 3).
        arch: ``"vit"`` (:class:`lipvit.model.ViT`) or, lipschitz family
            only, ``"hybrid"`` (:class:`lipvit.hybrid.HybridViT`: a 1-Lipschitz
            convolutional stem, gated attention blocks with a proven constant
            and a flattening head; certified by ``global``). The hybrid's
            stem downsamples by 4, so it needs ``patch_size=4``; it reads
            ``depth`` (attention blocks), ``embed_dim``, ``num_heads``,
            ``attn_radius``, ``stem_width`` and ``head_hidden``, centres pixels
            by ``mean`` and ignores ``std``. Checkpoints written before this
            field existed load as ``"vit"``. ``"cait"``, lipschitz family
            only (:class:`lipvit.cait.LipschitzCaiT`): the same stem, ``depth``
            gated self-attention blocks with per-token MLPs (``mlp_ratio``),
            class attention and a head on the class token; certified by
            ``ball`` (or ``global``). It also reads ``cls_heads``,
            ``cls_key_dim`` and ``cls_value_dim``.
        stem_width: hybrid and cait: channels of the stem's first convolution
            (the second has twice as many); even.
        head_hidden: hybrid and cait: width of the head's hidden layer; even.
        cls_heads: cait only: heads of the class attention (0: one per token).
        cls_key_dim: cait only: width of each class-attention head's query
            and keys.
        cls_value_dim: cait only: width of each class-attention head's values.
        cls_content: cait only: ``‖a_h‖``, the norm of every class-attention
            head's content direction, held fixed (its logits ``a_h · x̂_j``
            then spread by up to ``2 ‖a_h‖ attn_radius``); 0 leaves it free.
    """

    image_size: int = 8
    in_chans: int = 1
    num_classes: int = 10
    patch_size: int = 2
    embed_dim: int = 32
    depth: int = 2
    num_heads: int = 4
    mlp_ratio: float = 2.0
    family: Family = "standard"
    qkv_bias: bool = False
    attn_project: AttnProject = "frobenius"
    attn_radius: float = 1.0
    v_cap: float = 0.5
    o_cap: float = 0.5
    norm_eps: float = 1e-5
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    attention: AttentionKind = "dot"
    conv_kernel: int = 3
    arch: Arch = "vit"
    stem_width: int = 32
    head_hidden: int = 128
    cls_heads: int = 0
    cls_key_dim: int = 8
    cls_value_dim: int = 32
    cls_content: float = 0.0

    def __post_init__(self) -> None:
        positive = (
            "image_size",
            "in_chans",
            "num_classes",
            "patch_size",
            "embed_dim",
            "depth",
            "num_heads",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"patch_size {self.patch_size} must divide image_size {self.image_size}"
            )
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must divide embed_dim {self.embed_dim}"
            )
        if self.family not in ("standard", "lipschitz"):
            raise ValueError(
                f"family must be 'standard' or 'lipschitz', got {self.family!r}"
            )
        if self.attn_project not in ("frobenius", "token"):
            raise ValueError(
                "attn_project must be 'frobenius' or 'token', "
                f"got {self.attn_project!r}"
            )
        if self.attention not in ATTENTIONS:
            raise ValueError(
                f"attention must be one of {', '.join(ATTENTIONS)}, "
                f"got {self.attention!r}"
            )
        if self.attention != "dot" and self.family != "standard":
            raise ValueError(
                f"attention {self.attention!r} exists in the standard family only "
                "(the lipschitz family has its own capped dot-product attention)"
            )
        if (
            not isinstance(self.conv_kernel, int)
            or isinstance(self.conv_kernel, bool)
            or self.conv_kernel < 1
            or self.conv_kernel % 2 == 0
        ):
            raise ValueError(
                f"conv_kernel must be an odd positive integer, got {self.conv_kernel!r}"
            )
        if self.arch not in ARCHS:
            raise ValueError(
                f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.arch != "vit":
            self._check_conv_stem()
        if not self.mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio}")
        if not (isinstance(self.norm_eps, float | int) and self.norm_eps > 0):
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        if not self.attn_radius > 0:
            raise ValueError(f"attn_radius must be > 0, got {self.attn_radius}")
        for name in ("v_cap", "o_cap"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(
                    f"{name} must lie in (0, 1], got {getattr(self, name)}"
                )
        if self.family == "lipschitz" and self.qkv_bias:
            raise ValueError(
                "the lipschitz family has bias-free q and k: set qkv_bias=False"
            )
        # Empty statistics mean 0.5 per channel (so every preset builds as is).
        for name in ("mean", "std"):
            values = (
                tuple(float(v) for v in getattr(self, name)) or (0.5,) * self.in_chans
            )
            object.__setattr__(self, name, values)
        if len(self.mean) != self.in_chans or len(self.std) != self.in_chans:
            raise ValueError(
                f"mean and std need {self.in_chans} entries (one per channel), "
                f"got {len(self.mean)} and {len(self.std)}"
            )
        if any(not s > 0 for s in self.std):
            raise ValueError(f"std entries must be > 0, got {self.std}")

    def _check_conv_stem(self) -> None:
        """The hybrid's and CaiT's shared checks (their convolutional stem)."""
        if self.family != "lipschitz":
            raise ValueError(f"arch {self.arch!r} exists in the lipschitz family only")
        if self.patch_size != 4:
            raise ValueError(
                f"arch {self.arch!r} downsamples by 4 in its stem: patch_size must "
                f"be 4, got {self.patch_size}"
            )
        for name in ("stem_width", "head_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 2 \
                    or value % 2:
                raise ValueError(f"{name} must be an even integer ≥ 2, got {value!r}")
        if self.arch == "cait":
            if self.mlp_hidden % 2:
                raise ValueError(
                    f"arch 'cait' needs an even MLP width (MaxMin pairs its units), "
                    f"got embed_dim × mlp_ratio = {self.mlp_hidden}")
            content = self.cls_content
            if not (isinstance(content, float | int) and content >= 0):
                raise ValueError(f"cls_content must be ≥ 0, got {content!r}")
            for name, low in (("cls_heads", 0), ("cls_key_dim", 1),
                              ("cls_value_dim", 1)):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < low:
                    raise ValueError(
                        f"{name} must be an integer ≥ {low}, got {value!r}")

    @property
    def head_dim(self) -> int:
        """Head width ``d = D / H``."""
        return self.embed_dim // self.num_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def mlp_hidden(self) -> int:
        return max(1, int(round(self.embed_dim * self.mlp_ratio)))

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form stored in checkpoints (lists instead of tuples)."""
        out = dataclasses.asdict(self)
        out["mean"], out["std"] = list(self.mean), list(self.std)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ViTConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown ViTConfig fields: {sorted(unknown)}")
        return cls(
            **{k: tuple(v) if k in ("mean", "std") else v for k, v in data.items()}
        )


_FMNIST_3X64: dict[str, Any] = dict(
    image_size=28,
    in_chans=1,
    patch_size=4,
    embed_dim=64,
    depth=3,
    num_heads=4,
    mlp_ratio=2.0,
    # lipschitz family only (the standard family has no projection or caps): at
    # LoFAST's radius 1 and caps 0.5 the Frobenius projection of 50 tokens
    # leaves the class token about 0.03 of norm per block, and the model
    # underfits (79.6 % test after 20 epochs, 80.6 % train); radius 8 and caps 1
    # reach 80.4 % after 2 epochs against 72.5 % (measured on 1 CPU thread,
    # docs/results/fashion-mnist.md).
    attn_radius=8.0,
    v_cap=1.0,
    o_cap=1.0,
)

# Named architectures (size only: family, dataset statistics and classes are set
# by the caller). CIFAR sizes follow SpecFormer (ViT-S-like) and LoFAST §5.2.
PRESETS: dict[str, dict[str, Any]] = {
    "digits-tiny": dict(
        image_size=8,
        in_chans=1,
        patch_size=2,
        embed_dim=32,
        depth=2,
        num_heads=4,
        mlp_ratio=2.0,
    ),
    # `lipvit pipeline --fast`'s smoke test: 4×4 patches (4 + 1 tokens) keep
    # the MSVP model's second-order taylor models (n² per activation) cheap.
    "digits-smoke": dict(
        image_size=8,
        in_chans=1,
        patch_size=4,
        embed_dim=16,
        depth=2,
        num_heads=2,
        mlp_ratio=2.0,
    ),
    "digits-small": dict(
        image_size=8,
        in_chans=1,
        patch_size=2,
        embed_dim=64,
        depth=3,
        num_heads=8,
        mlp_ratio=2.0,
    ),
    # 28×28 grayscale (Fashion-MNIST, MNIST): patch 4 gives 7×7 = 49 patches
    # plus the class token; sized to train in well under 30 minutes per model
    # on a 2-core CPU.
    "fmnist-3x64": dict(_FMNIST_3X64),
    # The lipschitz family's Fashion-MNIST default: 7×7 patches (16 + 1 tokens)
    # and a wider model at about fmnist-3x64's training cost. fmnist-3x64's
    # lipschitz model is short of capacity (86.7 % train, 85.1 % test) and its
    # attention near uniform, so each 4×4 patch sees little beyond its own
    # pixels; this one reaches 87.4 % test in 24 minutes on one CPU thread
    # (docs/results/fashion-mnist.md). Projection radius and caps as fmnist-3x64.
    "fmnist-p7-3x128": dict(_FMNIST_3X64, patch_size=7, embed_dim=128),
    # The lipschitz family's Fashion-MNIST default: the hybrid ViT (a
    # 1-Lipschitz convolutional stem to 7×7 tokens of width 64, one gated
    # attention block, a flattening head), certified by its proven global
    # constant (docs/fashion-mnist.md). It exists in that family only, so
    # the preset names it.
    "fmnist-hybrid": dict(
        family="lipschitz",
        image_size=28,
        in_chans=1,
        patch_size=4,
        embed_dim=64,
        depth=1,
        num_heads=4,
        arch="hybrid",
        stem_width=32,
        head_hidden=128,
    ),
    # The lipschitz family's CaiT (docs/fashion-mnist.md): the hybrid's stem,
    # self-attention blocks with per-token MLPs, class attention with one head
    # per token, a head on the class token; certified by ``ball``.
    "fmnist-cait": dict(
        family="lipschitz",
        image_size=28,
        in_chans=1,
        patch_size=4,
        embed_dim=64,
        depth=2,
        num_heads=4,
        mlp_ratio=2.0,
        arch="cait",
        stem_width=32,
        head_hidden=128,
    ),
    "cifar-lofast-3x128": dict(
        image_size=32,
        in_chans=3,
        patch_size=4,
        embed_dim=128,
        depth=3,
        num_heads=8,
        mlp_ratio=2.0,
    ),
    "cifar-lofast-6x384": dict(
        image_size=32,
        in_chans=3,
        patch_size=4,
        embed_dim=384,
        depth=6,
        num_heads=8,
        mlp_ratio=2.0,
    ),
    "cifar-vit-s": dict(
        image_size=32,
        in_chans=3,
        patch_size=4,
        embed_dim=384,
        depth=12,
        num_heads=6,
        mlp_ratio=4.0,
    ),
}


def preset(name: str, **overrides: Any) -> ViTConfig:
    """Build the :class:`ViTConfig` of preset ``name`` with ``overrides`` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return ViTConfig(**{**PRESETS[name], **overrides})

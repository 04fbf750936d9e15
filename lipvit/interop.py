"""Foreign Vision Transformers: Hugging Face ``transformers`` and timm-layout weights.

Both map onto lipvit's standard family (:class:`lipvit.model.ViT`): pre-LN blocks,
an exact (erf) GELU MLP, a class token, learned positions (the class token's
included), a final LayerNorm and a linear head on the class token; the strided
patch convolution is lipvit's unfold + linear, the same map. Whatever else a
model holds is refused with a one-line reason
(:class:`~lipvit.errors.UnsupportedModelError`).

Key layouts (timm's names are lipvit's own, except the patch weight, which timm
stores as a conv kernel ``(D, C, p, p)`` and lipvit as ``(D, C·p·p)``):

=============================================  ===================================
transformers ``ViTForImageClassification``     timm ``VisionTransformer`` / lipvit
=============================================  ===================================
``vit.embeddings.cls_token``                   ``cls_token``
``vit.embeddings.position_embeddings``         ``pos_embed``
``vit.embeddings.patch_embeddings.projection`` ``patch_embed.proj``
``vit.encoder.layer.{i}.layernorm_before``     ``blocks.{i}.norm1``
``….attention.attention.{query,key,value}``    ``blocks.{i}.attn.qkv`` (stacked q; k; v)
``….attention.output.dense``                   ``blocks.{i}.attn.proj``
``….layernorm_after``                          ``blocks.{i}.norm2``
``….intermediate.dense``, ``….output.dense``   ``blocks.{i}.mlp.fc1``, ``….fc2``
``vit.layernorm``, ``classifier``              ``norm``, ``head``
=============================================  ===================================

(transformers ≥ 5 names the in-memory modules ``vit.layers.{i}.attention.q_proj``
…; both spellings are read, the saved one is written.) The LayerNorm epsilon
travels with the model (transformers' ``layer_norm_eps``, 1e-12 by default;
timm's 1e-6), and so does the input normalisation: a transformers directory's
``preprocessor_config.json`` (``image_mean``, ``image_std``; the
``ViTImageProcessor`` default 0.5 without one), a timm file's JSON config.
timm's LayerScale (``ls1.gamma``) is folded into the layer it scales,
``γ ⊙ (W h + b) = (diag(γ) W) h + γ ⊙ b``, exact up to float rounding.

A timm-layout file ``W.safetensors`` or ``W.pth`` needs the heads count, which no
weight shape records: a JSON ``W.json`` beside it, e.g. ``{"num_heads": 3}``,
optionally with ``mean``, ``std``, ``norm_eps`` and ``global_pool`` (only
``"token"``), or the same as keyword arguments of :func:`vit_from_timm`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lipvit.config import ViTConfig
from lipvit.errors import CheckpointError, LipvitError, UnsupportedModelError
from lipvit.files import atomic_path, check_writable
from lipvit.model import ViT

INSTALL_HINT = "pip install 'lipvit[hf]' (or: pip install transformers safetensors)"
HF_CONFIG = "config.json"
HF_PREPROCESSOR = "preprocessor_config.json"
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
TIMM_EPS = 1e-6
HF_EPS = 1e-12
HF_MEAN = 0.5  # ViTImageProcessor's default mean and std (every channel)

StateDict = dict[str, Tensor]


# ---------------------------------------------------------------- reading files


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise LipvitError(
            f"reading or writing .safetensors needs the safetensors package: "
            f"{INSTALL_HINT}"
        ) from None
    return safetensors.torch


def read_state_dict(path: str | Path) -> StateDict:
    """Tensors of a ``.safetensors`` file or of a torch file (``weights_only``).

    A torch file holding ``{"state_dict": ...}`` or ``{"model": ...}`` (common
    training wrappers) is unwrapped.

    Raises:
        CheckpointError: unreadable file, or one that holds no tensor dict.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    if path.suffix == ".safetensors":
        try:
            return dict(_safetensors().load_file(str(path)))
        except (OSError, ValueError, RuntimeError) as err:  # header/shape errors
            raise CheckpointError(
                f"{path}: unreadable safetensors file: {err}"
            ) from err
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is one line
        raise CheckpointError(f"{path}: not a readable torch file ({err})") from err
    return _tensor_dict(raw, path)


def _tensor_dict(raw: Any, path: Path) -> StateDict:
    for key in ("state_dict", "model"):
        if isinstance(raw, dict) and isinstance(raw.get(key), dict):
            raw = raw[key]
    if not (
        isinstance(raw, dict)
        and raw
        and all(isinstance(v, Tensor) for v in raw.values())
    ):
        raise CheckpointError(f"{path} holds no state dict of tensors")
    return dict(raw)


def is_timm_layout(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` uses timm's ViT key names (``blocks.0.attn.qkv.weight``)."""
    return "blocks.0.attn.qkv.weight" in state and "patch_embed.proj.weight" in state


def is_hf_layout(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` uses transformers' ViT key names (``vit.embeddings...``)."""
    return "vit.embeddings.cls_token" in state


# ---------------------------------------------------------------- timm layout

# timm features lipvit's ViT does not have, by key prefix or infix.
_TIMM_REFUSED = {
    "reg_token": "register tokens (reg_token)",
    "norm_pre": "a LayerNorm before the blocks (norm_pre)",
    "fc_norm": "global average pooling with fc_norm",
    "attn_pool": "attention pooling (attn_pool)",
    "pre_logits": "a pre-logits layer (representation_size)",
    "patch_embed.norm": "a LayerNorm inside the patch embedding",
    ".attn.q_norm": "q/k normalisation (qk_norm)",
    ".attn.k_norm": "q/k normalisation (qk_norm)",
    ".attn.norm": "a norm on the attention output (scale_attn_norm)",
    ".mlp.norm": "a norm inside the MLP (scale_mlp_norm)",
}


def _refuse(reason: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"cannot import this ViT: {reason}")


def _timm_config(
    state: StateDict,
    num_heads: int,
    norm_eps: float,
    mean: tuple[float, ...] | None,
    std: tuple[float, ...] | None,
) -> ViTConfig:
    """The :class:`ViTConfig` a timm-layout state dict implies (shapes + heads)."""
    for key in state:
        for part, what in _TIMM_REFUSED.items():
            infix = part.startswith(".") and f"{part}." in key
            if infix or key == part or key.startswith(f"{part}."):
                raise _refuse(f"{what} is not part of lipvit's ViT (key {key})")
    if "cls_token" not in state:
        raise _refuse("no class token; lipvit classifies from the class token")
    if "head.weight" not in state:
        raise _refuse("no classification head (head.weight)")
    if "pos_embed" not in state:
        raise _refuse("no learned position embedding (pos_embed)")
    conv = state["patch_embed.proj.weight"]  # (D, C, p, p)
    if conv.ndim != 4 or conv.shape[2] != conv.shape[3]:
        raise _refuse(f"patch kernel of shape {tuple(conv.shape)} is not (D, C, p, p)")
    D, C, p = conv.shape[0], conv.shape[1], conv.shape[2]
    tokens = state["pos_embed"].shape[1]
    grid = math.isqrt(tokens - 1)
    if grid * grid != tokens - 1:
        raise _refuse(
            f"pos_embed has {tokens} positions, not a square grid plus the class "
            "token (timm no_embed_class or a non-square image)"
        )
    depth = sum(1 for k in state if re.fullmatch(r"blocks\.\d+\.norm1\.weight", k))
    hidden = state["blocks.0.mlp.fc1.weight"].shape[0]
    try:
        return ViTConfig(
            image_size=grid * p,
            in_chans=C,
            num_classes=state["head.weight"].shape[0],
            patch_size=p,
            embed_dim=D,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=hidden / D,
            qkv_bias="blocks.0.attn.qkv.bias" in state,
            norm_eps=float(norm_eps),
            mean=tuple(mean or ()),
            std=tuple(std or ()),
        )
    except (ValueError, TypeError) as err:
        raise _refuse(str(err)) from err


def _fold_layer_scale(state: StateDict) -> StateDict:
    """Fold ``blocks.{i}.ls{1,2}.gamma`` into ``attn.proj`` / ``mlp.fc2``."""
    out = dict(state)
    for key in [k for k in state if re.fullmatch(r"blocks\.\d+\.ls[12]\.gamma", k)]:
        gamma = out.pop(key)  # (D,)
        layer = key.replace(".ls1.gamma", ".attn.proj").replace(
            ".ls2.gamma", ".mlp.fc2"
        )
        out[f"{layer}.weight"] = gamma[:, None] * out[f"{layer}.weight"]
        out[f"{layer}.bias"] = gamma * out[f"{layer}.bias"]
    return out


def vit_from_timm(
    state: StateDict,
    *,
    num_heads: int,
    norm_eps: float = TIMM_EPS,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
    global_pool: str = "token",
) -> ViT:
    """A lipvit :class:`ViT` holding the weights of a timm-layout state dict.

    Everything but the heads count is read off the weight shapes. The model is
    float64 if the weights are, float32 otherwise, in eval mode.

    Args:
        state: timm ``VisionTransformer`` keys (``blocks.{i}.attn.qkv.weight``…).
        num_heads: attention heads ``H``.
        norm_eps: LayerNorm epsilon (timm: 1e-6).
        mean, std: per-channel input normalisation (default 0.5 each).
        global_pool: timm's pooling; lipvit's ViT is ``"token"`` only.

    Raises:
        UnsupportedModelError: the model is no standard pre-LN class-token ViT.
    """
    if global_pool != "token":
        raise _refuse(f"global_pool {global_pool!r}; lipvit pools the class token")
    if not is_timm_layout(state):
        raise _refuse("no timm ViT keys (blocks.0.attn.qkv.weight, patch_embed.proj)")
    state = _fold_layer_scale(state)
    cfg = _timm_config(state, num_heads, norm_eps, mean, std)
    dtype = (
        torch.float64 if state["cls_token"].dtype == torch.float64 else torch.float32
    )
    lipvit_state = {k: v.to(dtype) for k, v in state.items()}
    conv = lipvit_state["patch_embed.proj.weight"]
    lipvit_state["patch_embed.proj.weight"] = conv.reshape(
        conv.shape[0], -1
    )  # (D, C·p·p)
    model = ViT(cfg).to(dtype)
    lipvit_state["mean"], lipvit_state["std"] = model.mean, model.std
    try:
        model.load_state_dict(lipvit_state)
    except RuntimeError as err:
        first = str(err).strip().splitlines()
        raise _refuse(" ".join(line.strip() for line in first[:3])) from err
    return model.eval()


def timm_state_dict(model: ViT) -> StateDict:
    """``model``'s weights in timm's layout (patch kernel as a conv, no buffers)."""
    cfg = _exportable(model)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    del state["mean"], state["std"]
    w = state["patch_embed.proj.weight"]
    state["patch_embed.proj.weight"] = w.reshape(
        cfg.embed_dim, cfg.in_chans, cfg.patch_size, cfg.patch_size
    ).contiguous()  # (D, C, p, p)
    return state


def _exportable(model: ViT) -> ViTConfig:
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ViTConfig):
        raise TypeError("export needs a lipvit ViT")
    if cfg.family != "standard":
        raise UnsupportedModelError(
            "only the standard family (LayerNorm, GELU MLP) has a timm or "
            "transformers counterpart; this model is lipschitz"
        )
    return cfg


def timm_json(path: str | Path) -> Path:
    """The JSON config file that belongs to timm-layout weights ``path``."""
    return Path(path).with_suffix(".json")


def load_timm(path: str | Path, **config: Any) -> ViT:
    """:func:`vit_from_timm` on a ``.safetensors`` / ``.pth`` file.

    ``config`` (``num_heads``, ``mean``, ``std``, ``norm_eps``, ``global_pool``)
    overrides the JSON file beside the weights (:func:`timm_json`).
    """
    return vit_from_timm(read_state_dict(path), **_timm_settings(Path(path), config))


def _timm_settings(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    side = timm_json(path)
    settings: dict[str, Any] = {}
    if side.is_file():
        try:
            settings = json.loads(side.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise LipvitError(f"{side}: not valid JSON ({err})") from None
        if not isinstance(settings, dict):
            raise LipvitError(f"{side}: expected a JSON object")
    settings.update(config)
    allowed = {"num_heads", "mean", "std", "norm_eps", "global_pool"}
    unknown = set(settings) - allowed
    if unknown:
        raise LipvitError(
            f"{side}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}"
        )
    if "num_heads" not in settings:
        raise LipvitError(
            f"timm-layout weights {path} need their heads count: write "
            f'{side} with {{"num_heads": H}} (optional: mean, std, norm_eps)'
        )
    return settings


def save_timm(model: ViT, path: str | Path, force: bool = False) -> Path:
    """Write ``model`` as timm-layout ``path`` (``.safetensors``) plus its JSON."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"timm export writes .safetensors, not {path.name}")
    cfg = _exportable(model)
    state = timm_state_dict(model)
    check_writable([path, timm_json(path)], force)
    with atomic_path(path, force) as tmp:
        _safetensors().save_file(state, str(tmp))
    settings = {
        "num_heads": cfg.num_heads,
        "norm_eps": cfg.norm_eps,
        "mean": list(cfg.mean),
        "std": list(cfg.std),
    }
    with atomic_path(timm_json(path), force) as tmp:
        tmp.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------- transformers

_BLOCK = r"vit\.(?:encoder\.layer|layers)\.(\d+)\."
# (pattern, lipvit/timm key) for both transformers spellings; q, k, v are
# stacked into ``qkv`` afterwards.
_HF_TO_TIMM: list[tuple[str, Callable[[re.Match[str]], str]]] = [
    (r"vit\.embeddings\.cls_token", lambda m: "cls_token"),
    (r"vit\.embeddings\.position_embeddings", lambda m: "pos_embed"),
    (
        r"vit\.embeddings\.patch_embeddings\.projection\.(weight|bias)",
        lambda m: f"patch_embed.proj.{m[1]}",
    ),
    (
        _BLOCK + r"layernorm_before\.(weight|bias)",
        lambda m: f"blocks.{m[1]}.norm1.{m[2]}",
    ),
    (
        _BLOCK + r"layernorm_after\.(weight|bias)",
        lambda m: f"blocks.{m[1]}.norm2.{m[2]}",
    ),
    (
        _BLOCK + r"attention\.(?:attention\.)?(query|key|value|q_proj|k_proj|v_proj)"
        r"\.(weight|bias)",
        lambda m: f"blocks.{m[1]}.attn.{m[2][0]}.{m[3]}",  # query → q, ...
    ),
    (
        _BLOCK + r"attention\.(?:output\.dense|o_proj)\.(weight|bias)",
        lambda m: f"blocks.{m[1]}.attn.proj.{m[2]}",
    ),
    (
        _BLOCK + r"(?:intermediate\.dense|mlp\.fc1)\.(weight|bias)",
        lambda m: f"blocks.{m[1]}.mlp.fc1.{m[2]}",
    ),
    (
        _BLOCK + r"(?:output\.dense|mlp\.fc2)\.(weight|bias)",
        lambda m: f"blocks.{m[1]}.mlp.fc2.{m[2]}",
    ),
    (r"vit\.layernorm\.(weight|bias)", lambda m: f"norm.{m[1]}"),
    (r"classifier\.(weight|bias)", lambda m: f"head.{m[1]}"),
]
_HF_UNUSED = ("vit.embeddings.mask_token",)  # masked-image pretraining only


def hf_to_timm(state: StateDict) -> StateDict:
    """transformers ViT keys → timm keys (q, k, v stacked into ``qkv``).

    Raises:
        UnsupportedModelError: a key with no lipvit counterpart (e.g. a pooler).
    """
    out: StateDict = {}
    for key, value in state.items():
        if key in _HF_UNUSED:
            continue
        for pattern, name in _HF_TO_TIMM:
            m = re.fullmatch(pattern, key)
            if m:
                out[name(m)] = value
                break
        else:
            raise _refuse(f"weight {key} has no counterpart in lipvit's ViT")
    for key in [k for k in out if re.fullmatch(r"blocks\.\d+\.attn\.q\.weight", k)]:
        stem = key[: -len("q.weight")]
        for kind in ("weight", "bias"):
            parts = [out.pop(f"{stem}{x}.{kind}", None) for x in "qkv"]
            if all(p is not None for p in parts):
                out[f"{stem}qkv.{kind}"] = torch.cat(parts, dim=0)  # (3D, ...)
            elif any(p is not None for p in parts):
                raise _refuse(f"{stem}: biases on some of q, k, v but not all")
    return out


def _square(value: Any, name: str) -> int:
    if isinstance(value, list | tuple):
        if len(value) != 2 or value[0] != value[1]:
            raise _refuse(f"{name} {value} is not square")
        value = value[0]
    return int(value)


def _hf_settings(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Check a transformers ViT config; return the settings it implies."""
    model_type = hf.get("model_type")
    if model_type != "vit":
        raise _refuse(
            f"model_type {model_type!r}; only transformers' 'vit' maps onto lipvit"
        )
    archs = hf.get("architectures") or ["ViTForImageClassification"]
    if "ViTForImageClassification" not in archs:
        raise _refuse(
            f"architecture {', '.join(archs)}; lipvit needs "
            "ViTForImageClassification (a classifier on the class token)"
        )
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise _refuse(f"hidden_act {act!r}; lipvit's MLP uses the exact (erf) GELU")
    return {
        "num_heads": int(hf["num_attention_heads"]),
        "norm_eps": float(hf.get("layer_norm_eps", HF_EPS)),
    }


def _check_hf_shapes(model: ViT, hf: Mapping[str, Any]) -> None:
    cfg = model.config
    expected = {
        "image_size": _square(hf.get("image_size", 224), "image_size"),
        "patch_size": _square(hf.get("patch_size", 16), "patch_size"),
        "in_chans": int(hf.get("num_channels", 3)),
        "embed_dim": int(hf["hidden_size"]),
        "depth": int(hf["num_hidden_layers"]),
        "mlp_hidden": int(hf["intermediate_size"]),
    }
    for name, value in expected.items():
        if getattr(cfg, name) != value:
            raise _refuse(
                f"config.json says {name} {value}, the weights {getattr(cfg, name)}"
            )


def _hf_normalization(directory: Path, in_chans: int) -> dict[str, Any]:
    path = directory / HF_PREPROCESSOR
    if not path.is_file():
        return {"mean": (HF_MEAN,) * in_chans, "std": (HF_MEAN,) * in_chans}
    try:
        proc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LipvitError(f"{path}: not valid JSON ({err})") from None
    if not proc.get("do_normalize", True):
        return {"mean": (0.0,) * in_chans, "std": (1.0,) * in_chans}

    def stat(name: str) -> tuple[float, ...]:
        value = proc.get(name, HF_MEAN)
        values = value if isinstance(value, list) else [value] * in_chans
        return tuple(float(v) for v in values)

    return {"mean": stat("image_mean"), "std": stat("image_std")}


def _hf_weights(directory: Path) -> StateDict:
    index = directory / "model.safetensors.index.json"
    if index.is_file():  # sharded
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: StateDict = {}
        for shard in shards:
            state.update(read_state_dict(directory / shard))
        return state
    for name in HF_WEIGHTS:
        if (directory / name).is_file():
            return read_state_dict(directory / name)
    raise CheckpointError(
        f"{directory} has no weights ({' or '.join(HF_WEIGHTS)}): not a saved "
        "transformers model"
    )


def vit_from_hf(
    source: str | Path | Any,
    *,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
) -> ViT:
    """A lipvit :class:`ViT` equal to a transformers ``ViTForImageClassification``.

    Args:
        source: a directory written by ``save_pretrained`` (``config.json`` and
            ``model.safetensors`` or ``pytorch_model.bin``; read without
            importing transformers), or the model object itself.
        mean, std: input normalisation; default: the directory's
            ``preprocessor_config.json``, else 0.5 per channel.

    Raises:
        UnsupportedModelError: a configuration lipvit cannot represent.
        CheckpointError: a missing or unreadable file.
    """
    if isinstance(source, str | Path):
        directory = Path(source)
        config_path = directory / HF_CONFIG
        if not config_path.is_file():
            raise CheckpointError(
                f"{directory} has no {HF_CONFIG}: not a saved transformers model"
            )
        try:
            hf = json.loads(config_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{config_path}: not valid JSON ({err})") from None
        state = _hf_weights(directory)
        norm = _hf_normalization(directory, int(hf.get("num_channels", 3)))
    else:
        if not hasattr(source, "config") or not hasattr(source, "state_dict"):
            raise TypeError("vit_from_hf takes a directory or a transformers model")
        hf = source.config.to_dict()
        state = dict(source.state_dict())
        channels = int(hf.get("num_channels", 3))
        norm = {"mean": (HF_MEAN,) * channels, "std": (HF_MEAN,) * channels}
    if mean is not None:
        norm["mean"] = tuple(mean)
    if std is not None:
        norm["std"] = tuple(std)
    settings = _hf_settings(hf)
    model = vit_from_timm(hf_to_timm(state), **settings, **norm)
    _check_hf_shapes(model, hf)
    return model


def hf_config(model: ViT) -> dict[str, Any]:
    """transformers ``ViTConfig`` fields (``config.json``) of ``model``."""
    cfg = _exportable(model)
    labels = {str(i): f"LABEL_{i}" for i in range(cfg.num_classes)}
    return {
        "architectures": ["ViTForImageClassification"],
        "model_type": "vit",
        "image_size": cfg.image_size,
        "patch_size": cfg.patch_size,
        "num_channels": cfg.in_chans,
        "hidden_size": cfg.embed_dim,
        "num_hidden_layers": cfg.depth,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.mlp_hidden,
        "hidden_act": "gelu",
        "layer_norm_eps": cfg.norm_eps,
        "qkv_bias": cfg.qkv_bias,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "id2label": labels,
        "label2id": {v: int(k) for k, v in labels.items()},
    }


def hf_state_dict(model: ViT) -> StateDict:
    """``model``'s weights under transformers' saved ViT key names."""
    state = timm_state_dict(model)
    out: StateDict = {
        "vit.embeddings.cls_token": state.pop("cls_token"),
        "vit.embeddings.position_embeddings": state.pop("pos_embed"),
    }
    names = {
        r"patch_embed\.proj\.(\w+)": "vit.embeddings.patch_embeddings.projection.{}",
        r"norm\.(\w+)": "vit.layernorm.{}",
        r"head\.(\w+)": "classifier.{}",
    }
    block = {
        "norm1": "layernorm_before",
        "norm2": "layernorm_after",
        "attn.proj": "attention.output.dense",
        "mlp.fc1": "intermediate.dense",
        "mlp.fc2": "output.dense",
    }
    for key, value in state.items():
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", key)
        if m and m[2] == "attn.qkv":
            prefix = f"vit.encoder.layer.{m[1]}.attention.attention"
            for name, part in zip(
                ("query", "key", "value"), value.chunk(3), strict=True
            ):
                out[f"{prefix}.{name}.{m[3]}"] = part.contiguous()  # (D, ...)
        elif m:
            out[f"vit.encoder.layer.{m[1]}.{block[m[2]]}.{m[3]}"] = value
        else:
            pattern, template = next(
                (p, t) for p, t in names.items() if re.fullmatch(p, key)
            )
            out[template.format(re.fullmatch(pattern, key)[1])] = value
    return out


def save_hf(model: ViT, directory: str | Path, force: bool = False) -> Path:
    """Write ``model`` as a transformers ViT directory (``from_pretrained`` reads it).

    Files: ``config.json``, ``preprocessor_config.json`` (the model's image size
    and normalisation) and ``model.safetensors``.
    """
    directory = Path(directory)
    cfg = _exportable(model)
    if directory.exists() and not directory.is_dir():
        raise LipvitError(f"{directory} exists and is not a directory")
    files = [directory / n for n in (HF_CONFIG, HF_PREPROCESSOR, HF_WEIGHTS[0])]
    check_writable(files, force)
    state = hf_state_dict(model)
    preprocessor = {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": cfg.image_size, "width": cfg.image_size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(cfg.mean),
        "image_std": list(cfg.std),
    }
    with atomic_path(files[2], force) as tmp:
        _safetensors().save_file(state, str(tmp), metadata={"format": "pt"})
    for path, data in zip(files[:2], (hf_config(model), preprocessor), strict=True):
        with atomic_path(path, force) as tmp:
            tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return directory


def small_transformers_vit(seed: int = 0, **config: Any) -> Any:
    """A small random transformers ``ViTForImageClassification`` (no hub access).

    Digits-sized by default (8×8 grayscale, 10 classes, ``D = 32``, 2 blocks,
    4 heads, bias-free q/k/v, since the attention bounds refuse query/key
    biases); ``config`` overrides any ``transformers.ViTConfig`` field. For
    examples and experiments; needs the ``[hf]`` extra.
    """
    try:
        import transformers
    except ImportError:
        raise LipvitError(f"this needs transformers: {INSTALL_HINT}") from None
    base = dict(
        image_size=8,
        patch_size=2,
        num_channels=1,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=10,
        qkv_bias=False,
    )
    torch.manual_seed(seed)
    hf_config = transformers.ViTConfig(**{**base, **config})
    return transformers.ViTForImageClassification(hf_config).eval()


# ---------------------------------------------------------------- dispatch


def load_foreign(path: str | Path) -> tuple[ViT, str]:
    """A transformers directory or timm-layout file as a lipvit ViT, and its format.

    Formats: ``"transformers"`` (a directory, or a weights file inside one) and
    ``"timm"`` (a ``.safetensors`` / torch file with timm keys).
    """
    path = Path(path)
    if path.is_dir():
        return vit_from_hf(path), "transformers"
    state = read_state_dict(path)
    if is_hf_layout(state):
        return vit_from_hf(path.parent), "transformers"
    if is_timm_layout(state):
        return vit_from_timm(state, **_timm_settings(path, {})), "timm"
    raise CheckpointError(
        f"{path} is neither a lipvit checkpoint nor a transformers/timm ViT"
    )

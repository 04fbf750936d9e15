"""Foreign ViTs: transformers and timm-layout weights give the same logits in lipvit.

The reference is a small random ``transformers.ViTForImageClassification`` built
offline; the timm-layout files are written here from transformers' saved keys
using timm's documented names (``blocks.{i}.attn.qkv.weight`` …).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from lipvit.checkpoint import load_checkpoint  # noqa: E402
from lipvit.errors import LipvitError, UnsupportedModelError  # noqa: E402
from lipvit.interop import (  # noqa: E402
    hf_state_dict,
    save_hf,
    save_timm,
    small_transformers_vit,
    vit_from_hf,
    vit_from_timm,
)

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def random_hf_vit(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A small transformers ViT with every weight random (LayerNorms included);
    q/k/v biases on (transformers' default) unless ``overrides`` say otherwise."""
    config = dict(hidden_size=16, intermediate_size=24, qkv_bias=True)
    model = small_transformers_vit(seed, **{**config, **overrides}).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return model


def hf_logits(model, x: torch.Tensor, mean: float = 0.5, std: float = 0.5):
    """transformers' logits on images ``x`` in [0, 1] (its processor normalises)."""
    with torch.no_grad():
        return model(pixel_values=(x - mean) / std).logits


def images(dtype: torch.dtype, channels: int = 1, size: int = 8, n: int = 5):
    g = torch.Generator().manual_seed(1)
    return torch.rand(n, channels, size, size, generator=g, dtype=torch.float64).to(
        dtype
    )


def max_diff(model, reference, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x) - reference).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_transformers_directory_logits_equal(tmp_path: Path, dtype) -> None:
    hf = random_hf_vit(dtype)
    hf.save_pretrained(tmp_path / "hf")
    ckpt = load_checkpoint(tmp_path / "hf")
    assert ckpt.raw["format"] == "transformers"
    assert ckpt.config.norm_eps == 1e-12 and ckpt.config.qkv_bias
    assert next(ckpt.model.parameters()).dtype == dtype
    x = images(dtype)
    assert max_diff(ckpt.model, hf_logits(hf, x), x) <= TOL[dtype]


def test_transformers_object_and_normalisation(tmp_path: Path) -> None:
    hf = random_hf_vit(torch.float64, seed=3, num_channels=3, qkv_bias=False)
    x = images(torch.float64, channels=3)
    model = vit_from_hf(hf)
    assert not model.config.qkv_bias
    assert max_diff(model, hf_logits(hf, x), x) <= 1e-10
    # The processor's statistics travel with a saved directory.
    hf.save_pretrained(tmp_path / "hf")
    mean, std = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
    (tmp_path / "hf" / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": mean, "image_std": std, "do_normalize": True})
    )
    model = load_checkpoint(tmp_path / "hf").model
    assert model.config.mean == tuple(mean) and model.config.std == tuple(std)
    m, s = torch.tensor(mean).reshape(1, 3, 1, 1), torch.tensor(std).reshape(1, 3, 1, 1)
    assert max_diff(model, hf_logits(hf, x, m.double(), s.double()), x) <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_export_round_trips_through_transformers(tmp_path: Path, dtype) -> None:
    hf = random_hf_vit(dtype, seed=5)
    model = vit_from_hf(hf)
    save_hf(model, tmp_path / "out")
    with pytest.raises(LipvitError, match="--force"):
        save_hf(model, tmp_path / "out")
    back = transformers.ViTForImageClassification.from_pretrained(tmp_path / "out")
    back = back.to(dtype).eval()
    x = images(dtype)
    assert max_diff(model, hf_logits(back, x), x) <= TOL[dtype]
    again = load_checkpoint(tmp_path / "out").model
    for (k, a), b in zip(
        model.state_dict().items(), again.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b.to(a.dtype)), k


def timm_layout(hf) -> dict[str, torch.Tensor]:
    """timm ``VisionTransformer`` keys for a transformers ViT (written by hand)."""
    cfg = hf.config
    src = {k: v.detach().clone() for k, v in hf_state_dict(vit_from_hf(hf)).items()}
    out = {
        "cls_token": src["vit.embeddings.cls_token"],
        "pos_embed": src["vit.embeddings.position_embeddings"],
        "norm.weight": src["vit.layernorm.weight"],
        "norm.bias": src["vit.layernorm.bias"],
        "head.weight": src["classifier.weight"],
        "head.bias": src["classifier.bias"],
    }
    for kind in ("weight", "bias"):
        out[f"patch_embed.proj.{kind}"] = src[
            f"vit.embeddings.patch_embeddings.projection.{kind}"
        ]
    for i in range(cfg.num_hidden_layers):
        hf_block = f"vit.encoder.layer.{i}"
        for kind in ("weight", "bias"):
            names = {
                "norm1": "layernorm_before",
                "norm2": "layernorm_after",
                "attn.proj": "attention.output.dense",
                "mlp.fc1": "intermediate.dense",
                "mlp.fc2": "output.dense",
            }
            for timm_name, hf_name in names.items():
                out[f"blocks.{i}.{timm_name}.{kind}"] = src[
                    f"{hf_block}.{hf_name}.{kind}"
                ]
            qkv = [
                src.get(f"{hf_block}.attention.attention.{n}.{kind}")
                for n in ("query", "key", "value")
            ]
            if qkv[0] is not None:
                out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(qkv)
    return out


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_timm_layout_logits_equal(tmp_path: Path, dtype, suffix: str) -> None:
    hf = random_hf_vit(dtype, seed=7, layer_norm_eps=1e-6)  # timm's epsilon
    path = tmp_path / f"vit{suffix}"
    state = timm_layout(hf)
    assert conv_shape(state) == (16, 1, 2, 2)
    if suffix == ".safetensors":
        safetensors_torch.save_file(state, str(path))
    else:
        torch.save({"model": state}, path)
    with pytest.raises(LipvitError, match="num_heads"):
        load_checkpoint(path)
    path.with_suffix(".json").write_text(json.dumps({"num_heads": 4}))
    ckpt = load_checkpoint(path)
    assert ckpt.raw["format"] == "timm" and ckpt.config.norm_eps == 1e-6
    x = images(dtype)
    assert max_diff(ckpt.model, hf_logits(hf, x), x) <= TOL[dtype]
    # Export in timm layout and back: the same weights.
    save_timm(ckpt.model, tmp_path / "again.safetensors")
    again = load_checkpoint(tmp_path / "again.safetensors").model
    assert max_diff(again, ckpt.model(x).detach(), x) == 0.0


def conv_shape(state: dict[str, torch.Tensor]) -> tuple[int, ...]:
    return tuple(state["patch_embed.proj.weight"].shape)


def test_timm_layer_scale_is_folded() -> None:
    hf = random_hf_vit(torch.float64, seed=9, layer_norm_eps=1e-6)
    state = timm_layout(hf)
    g = torch.Generator().manual_seed(0)
    gammas = {}
    for i in range(2):
        for j in (1, 2):
            gammas[(i, j)] = torch.rand(16, generator=g, dtype=torch.float64) + 0.5
            state[f"blocks.{i}.ls{j}.gamma"] = gammas[(i, j)]
    # Reference: transformers with each residual branch's output scaled by γ.
    hooks = []
    for name, module in hf.named_modules():
        for (i, j), gamma in gammas.items():
            layer = ("attention.output.dense", "output.dense")[j - 1]
            new = ("attention.o_proj", "mlp.fc2")[j - 1]
            if name in (f"vit.encoder.layer.{i}.{layer}", f"vit.layers.{i}.{new}"):
                hooks.append(
                    module.register_forward_hook(lambda m, a, out, s=gamma: out * s)
                )
    assert len(hooks) == 4
    x = images(torch.float64)
    model = vit_from_timm(state, num_heads=4)
    assert max_diff(model, hf_logits(hf, x), x) <= 1e-10


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_act="gelu_new"), "exact \\(erf\\) GELU"),
        (dict(model_type="deit"), "model_type 'deit'"),
        (dict(architectures=["ViTModel"]), "ViTForImageClassification"),
        (dict(image_size=[8, 6]), "not square"),
    ],
)
def test_transformers_refusals(tmp_path: Path, overrides, message: str) -> None:
    random_hf_vit().save_pretrained(tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, **overrides}))
    with pytest.raises(UnsupportedModelError, match=message) as err:
        load_checkpoint(tmp_path / "hf")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "key, shape, message",
    [
        ("reg_token", (1, 4, 16), "register tokens"),
        ("fc_norm.weight", (16,), "global average pooling"),
        ("blocks.0.attn.q_norm.weight", (4,), "qk_norm"),
    ],
)
def test_timm_refusals(key: str, shape, message: str) -> None:
    state = timm_layout(random_hf_vit(layer_norm_eps=1e-6))
    state[key] = torch.zeros(shape)
    with pytest.raises(UnsupportedModelError, match=message):
        vit_from_timm(state, num_heads=4)
    state.pop(key)
    with pytest.raises(UnsupportedModelError, match="num_heads 5 must divide"):
        vit_from_timm(state, num_heads=5)
    with pytest.raises(UnsupportedModelError, match="global_pool 'avg'"):
        vit_from_timm(state, num_heads=4, global_pool="avg")


def test_lipschitz_family_is_not_exported(tmp_path: Path) -> None:
    from conftest import tiny_config

    from lipvit.model import ViT

    with pytest.raises(UnsupportedModelError, match="standard family"):
        save_hf(ViT(tiny_config("lipschitz")), tmp_path / "x")


# ---------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A saved random transformers ViT that fits digits (8×8, 1 channel, 10).

    Bias-free q, k, v: lipvit's attention bounds refuse query/key biases.
    """
    path = tmp_path_factory.mktemp("hf") / "vit"
    random_hf_vit(seed=11, qkv_bias=False).save_pretrained(path)
    return path


def cli(*args: str):
    from click.testing import CliRunner

    from lipvit.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_commands_read_an_imported_model(hf_dir: Path, tmp_path: Path) -> None:
    result = cli("info", "--ckpt", hf_dir)
    assert result.exit_code == 0, result.output
    assert "imported transformers ViT" in result.output and "norm_eps=1e-12" in (
        result.output
    )
    out = tmp_path / "cert.json"
    result = cli(
        "certify",
        "--ckpt",
        hf_dir,
        "--dataset",
        "digits",
        "--n",
        "2",
        "--eps",
        "0.01",
        "--json",
        out,
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["n"] == 2
    # Query/key biases (transformers' default) are refused by the bounds.
    random_hf_vit(seed=11).save_pretrained(tmp_path / "biased")
    result = cli(
        "certify",
        "--ckpt",
        tmp_path / "biased",
        "--dataset",
        "digits",
        "--n",
        "4",
        "--eps",
        "0.01",
    )
    assert result.exit_code == 1 and "bias-free query and key" in result.output
    # The dataset must fit the model; no dataset recorded means --dataset.
    result = cli("certify", "--ckpt", hf_dir, "--n", "4", "--eps", "0.01")
    assert result.exit_code == 1 and "pass --dataset" in result.output


def test_dataset_mismatch_is_one_line(tmp_path: Path) -> None:
    random_hf_vit(num_channels=3).save_pretrained(tmp_path / "rgb")
    result = cli(
        "certify",
        "--ckpt",
        tmp_path / "rgb",
        "--dataset",
        "digits",
        "--n",
        "2",
        "--eps",
        "0.01",
    )
    assert result.exit_code == 1
    assert "the model expects (3, 8, 8)" in result.output
    assert "Traceback" not in result.output and len(result.output.splitlines()) == 1


def test_export_command_round_trips(hf_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "lip.pt"
    assert (
        cli("export", "--ckpt", hf_dir, "--out", out, "--format", "lipvit").exit_code
        == 0
    )
    assert cli("export", "--ckpt", out, "--out", tmp_path / "hf").exit_code == 0
    result = cli("export", "--ckpt", out, "--out", tmp_path / "hf")
    assert result.exit_code == 1 and "--force" in result.output
    assert (
        cli(
            "export",
            "--ckpt",
            out,
            "--out",
            tmp_path / "t.safetensors",
            "--format",
            "timm",
        ).exit_code
        == 0
    )
    x = images(torch.float32)
    reference = load_checkpoint(hf_dir).model(x).detach()
    for path in (out, tmp_path / "hf", tmp_path / "t.safetensors"):
        assert max_diff(load_checkpoint(path).model, reference, x) == 0.0


@pytest.mark.slow
def test_train_init_fine_tunes_an_imported_model(hf_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ft.pt"
    result = cli(
        "train",
        "--init",
        hf_dir,
        "--dataset",
        "digits",
        "--msvp",
        "1e-3",
        "--epochs",
        "1",
        "--no-progress",
        "--device",
        "cpu",
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    tuned = load_checkpoint(out)
    start = load_checkpoint(hf_dir)
    assert tuned.config == start.config and tuned.msvp is not None
    assert tuned.summary["train_config"]["msvp"] == [1e-3] * 3
    moved = (tuned.model.head.weight - start.model.head.weight).abs().max().detach()
    assert 0 < float(moved) < 1  # trained from the imported weights, not anew
    result = cli(
        "train",
        "--init",
        hf_dir,
        "--dataset",
        "digits",
        "--embed-dim",
        "8",
        "--out",
        tmp_path / "x.pt",
    )
    assert result.exit_code == 1 and "drop --embed-dim" in result.output


def test_without_safetensors_the_error_says_how_to_install(tmp_path, monkeypatch):
    import sys

    path = tmp_path / "w.safetensors"
    safetensors_torch.save_file({"x": torch.zeros(1)}, str(path))
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(LipvitError, match=r"pip install 'lipvit\[hf\]'"):
        load_checkpoint(path)

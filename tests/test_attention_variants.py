"""Attention variants (lipvit.attention): shapes, defining properties, MSVP,
checkpoints, resumable training, analysis tools and refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from lipvit.analysis.attacks import robust_accuracy
from lipvit.analysis.jacobian import block_jacobian_sigma, full_jacobian
from lipvit.analysis.spectrum import jacobian_spectrum, weight_spectra
from lipvit.analysis.tightness import layer_tightness, network_tightness
from lipvit.certify.crown.bounds import check_crown_support
from lipvit.certify.lofast.network import network_bound

from lipvit.attention import ConvMixing, L2Attention, LipNormAttention, SCSAttention
from lipvit.checkpoint import load_checkpoint, save_checkpoint
from lipvit.cli import main
from lipvit.config import ATTENTIONS, ViTConfig
from lipvit.errors import UnsupportedModelError
from lipvit.model import Attention, ViT, build_attention
from lipvit.msvp import MSVP
from lipvit.train import TrainConfig, head_sigmas, train
from tests.conftest import tiny_config

WITH_QKV = ("dot", "l2", "lipnorm", "scsa")
VARIANTS = ("l2", "lipnorm", "scsa", "conv")


def _model(attention: str, seed: int = 0, **kw) -> ViT:
    torch.manual_seed(seed)
    return ViT(tiny_config(attention=attention, **kw)).double().eval()


def _mixer(attention: str, std: float = 0.5, seed: int = 0, **kw) -> torch.nn.Module:
    """One token mixer, D = 8, H = 2, weights N(0, std²), float64."""
    torch.manual_seed(seed)
    cfg = ViTConfig(embed_dim=8, num_heads=2, image_size=4, patch_size=2,
                    attention=attention, **kw)
    m = build_attention(cfg).double()
    for p in m.parameters():
        if p.ndim >= 2:
            torch.nn.init.normal_(p, std=std)
    return m


# ------------------------------------------------------------------ config


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_forward_shapes(attention: str) -> None:
    model = _model(attention)
    x = torch.rand(3, 1, 8, 8, dtype=torch.float64)
    assert model(x).shape == (3, 10)
    X = model.embed(x)
    assert model.blocks[0].attn(X).shape == X.shape


def test_variant_classes() -> None:
    expected = {"dot": Attention, "l2": L2Attention, "lipnorm": LipNormAttention,
                "scsa": SCSAttention, "conv": ConvMixing}
    for name, cls in expected.items():
        assert type(_model(name).blocks[0].attn) is cls


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(attention="flash"), "attention must be one of"),
        (dict(attention="l2", family="lipschitz"), "standard family only"),
        (dict(attention="conv", conv_kernel=4), "odd positive"),
        (dict(attention="conv", conv_kernel=0), "odd positive"),
    ],
)
def test_config_validation(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_checkpoint_round_trip(attention: str, tmp_path: Path) -> None:
    model = _model(attention).float()
    path = save_checkpoint(tmp_path / "m.pt", model)
    ckpt = load_checkpoint(path)
    assert ckpt.config.attention == attention
    x = torch.rand(2, 1, 8, 8)
    assert torch.equal(ckpt.model(x), model(x))


def test_old_checkpoint_without_attention_loads_as_dot(tmp_path: Path) -> None:
    model = _model("dot").float()
    path = save_checkpoint(tmp_path / "m.pt", model)
    raw = torch.load(path, weights_only=True)
    for key in ("attention", "conv_kernel"):
        del raw["model_config"][key]  # as written before the field existed
    torch.save(raw, path)
    ckpt = load_checkpoint(path)
    assert ckpt.config.attention == "dot"
    x = torch.rand(2, 1, 8, 8)
    assert torch.equal(ckpt.model(x), model(x))


# ------------------------------------------------------------------ l2


def test_l2_ties_query_and_key() -> None:
    attn = _mixer("l2")
    W = attn.head_weights()
    assert W.W_q is W.W_k  # one tensor: tied by construction
    assert W.W_q.data_ptr() == attn.qk.weight.data_ptr()
    assert attn.head_biases().b_q is None and attn.head_biases().b_k is None


def test_l2_forward_is_the_l2_formula() -> None:
    """F(X) = Σ_h softmax(−‖x_i W_q − x_j W_k‖²/√d) X A_h W_V[h] W_o[h] + b_o."""
    attn = _mixer("l2")
    X = torch.randn(3, 5, 8, dtype=torch.float64)
    W_q, W_k, W_v, W_o = attn.head_weights()
    d = W_q.shape[-1]
    q = torch.einsum("bnD,hDd->bhnd", X, W_q)
    k = torch.einsum("bnD,hDd->bhnd", X, W_k)
    dist2 = ((q[:, :, :, None] - k[:, :, None]) ** 2).sum(-1)  # (B, H, N, N)
    P = torch.softmax(-dist2 / math.sqrt(d), dim=-1)
    A = W_q @ W_q.mT / math.sqrt(d)  # (H, D, D)
    W_V = attn.v.weight.reshape(2, d, 8).mT
    assert torch.allclose(W_v, A @ W_V)
    heads = P @ torch.einsum("bnD,hDd->bhnd", X, W_v)  # (B, H, N, d)
    want = torch.einsum("bhnd,hdE->bnE", heads, W_o) + attn.proj.bias
    assert torch.allclose(attn(X), want, atol=1e-12)


def _sigma_along_ray(attention: str, scales) -> list[float]:
    """σ_max of the mixer's Jacobian at t·X, X with a zero token (Kim et al.'s
    counter-example to the Lipschitz continuity of dot-product attention)."""
    attn = _mixer(attention)
    X = torch.randn(1, 5, 8, dtype=torch.float64, generator=torch.Generator()
                    .manual_seed(1))
    X[:, 0] = 0
    return [float(block_jacobian_sigma(attn, t * X, exact=True)[0]) for t in scales]


def test_l2_attention_is_lipschitz_where_dot_attention_is_not() -> None:
    scales = (1.0, 10.0, 100.0)
    dot = _sigma_along_ray("dot", scales)
    l2 = _sigma_along_ray("l2", scales)
    # Dot product: the row of the zero token stays uniform while the tokens
    # spread, so the Jacobian grows like t².
    assert dot[2] / dot[0] > 1e3
    # L2 with tied W_q = W_k: bounded (Kim et al. 2021, Theorem 3.2).
    assert max(l2) < 2 * l2[0]
    assert l2[2] < 1.01 * l2[1]


# ------------------------------------------------------------------ lipnorm


def test_lipnorm_scores_are_normalised_and_scale_free() -> None:
    attn = _mixer("lipnorm")
    X = torch.randn(2, 5, 8, dtype=torch.float64)
    for t in (1e-2, 1.0, 1e3):
        logits = attn.attention_logits(t * X)
        assert logits.abs().max() <= 1 + 1e-12  # |q_i·k_j| ≤ ‖Q‖_F max‖k_j‖ ≤ c
    # c(tX) = t² c(X): the logits, hence P, do not depend on the scale.
    assert torch.allclose(attn.attention_logits(1e3 * X), attn.attention_logits(X))
    q, k, v = (t.reshape(2, 5, 2, 4).transpose(1, 2)
               for t in attn.qkv(X).chunk(3, dim=-1))
    c = torch.stack([
        q.flatten(2).norm(dim=-1) * k.norm(dim=-1).amax(-1),
        q.flatten(2).norm(dim=-1) * v.norm(dim=-1).amax(-1),
        k.norm(dim=-1).amax(-1) * v.norm(dim=-1).amax(-1),
    ]).amax(0)  # (B, H)
    assert torch.allclose(attn.attention_logits(X), q @ k.mT / c[..., None, None])
    # Degree-1 homogeneous, so its Jacobian does not grow along a ray.
    sigma = _sigma_along_ray("lipnorm", (1.0, 100.0))
    assert sigma[1] < 1.01 * sigma[0]


# ------------------------------------------------------------------ scsa


def test_scsa_normalises_queries_and_keys() -> None:
    attn = _mixer("scsa")
    X = torch.randn(2, 5, 8, dtype=torch.float64)
    tau = attn.tau()
    assert torch.allclose(tau, torch.full((2,), 10.0, dtype=tau.dtype))
    cos = attn.attention_logits(X) / tau[:, None, None]
    assert cos.abs().max() <= 1 + 1e-12  # cosine similarities
    q, k, _ = (t.reshape(2, 5, 2, 4).transpose(1, 2)
               for t in attn.qkv(X).chunk(3, dim=-1))
    assert torch.allclose(attn.normalize(q).norm(dim=-1),
                          torch.ones(2, 2, 5, dtype=X.dtype), atol=1e-4)
    # Normalised q, k and v: the output barely depends on the input's scale.
    assert torch.allclose(attn(10 * X), attn(X), atol=1e-6)
    with torch.no_grad():
        attn.log_tau.fill_(10.0)
    assert float(attn.tau().detach().max()) == pytest.approx(100.0)  # clamped


# ------------------------------------------------------------------ conv


@pytest.mark.parametrize("kernel", [1, 3, 5])
def test_conv_is_local(kernel: int) -> None:
    attn = _mixer("conv", conv_kernel=kernel)
    N, D = 7, 8
    X = torch.randn(2, N, D, dtype=torch.float64)
    J = full_jacobian(attn, X).reshape(2, N, D, N, D)  # ∂out[i] / ∂in[j]
    block = J.abs().amax(dim=(0, 2, 4))  # (N, N)
    i, j = torch.meshgrid(torch.arange(N), torch.arange(N), indexing="ij")
    far = (i - j).abs() > kernel // 2
    assert float(block[far].max()) == 0.0
    assert bool((block[~far] > 0).all())


def test_conv_pools_all_tokens() -> None:
    from lipvit.analysis.features import penultimate_features

    model = _model("conv")
    tokens = torch.randn(2, 17, 16, dtype=torch.float64)
    want = model.head(tokens.mean(dim=1))
    assert torch.allclose(model.forward_head(tokens), want)
    x = torch.rand(2, 1, 8, 8, dtype=torch.float64)
    assert torch.allclose(penultimate_features(model, x),
                          model.forward_features(x).mean(dim=1))


# ------------------------------------------------------------------ MSVP


@pytest.mark.parametrize("attention", WITH_QKV)
def test_msvp_lowers_sigma_max(attention: str) -> None:
    model = _model(attention).float()
    before = head_sigmas(model)[:, :3]  # (L, 3, H) exact
    msvp = MSVP(model, (1.0, 1.0, 1.0), n_iter=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(30):
        penalty, _ = msvp()
        opt.zero_grad()
        penalty.backward()
        opt.step()
    after = head_sigmas(model)[:, :3]
    assert float(after.max()) < float(before.max())
    assert float(after.mean()) < 0.9 * float(before.mean())


def test_msvp_counts_tied_l2_matrix_once_per_role() -> None:
    model = _model("l2").float()
    msvp = MSVP(model, (1.0, 1.0, 1.0))
    W = msvp.weights()  # (L, 3, H, D, d)
    assert torch.equal(W[:, 0], W[:, 1])  # W_q = W_k: penalised as both


def test_msvp_refuses_conv() -> None:
    with pytest.raises(UnsupportedModelError, match="attention='conv'"):
        MSVP(_model("conv"), (1e-3,) * 3)


# ------------------------------------------------------------------ training


class _Stop(Exception):
    pass


def _stop_after_first(line: str) -> None:
    if line.startswith("epoch   1/2"):
        raise _Stop


@pytest.mark.parametrize("attention", ["l2", "scsa", "conv"])
def test_training_resumes_exactly(attention: str, small_digits, tmp_path) -> None:
    cfg = tiny_config(attention=attention, mean=small_digits.mean,
                      std=small_digits.std)
    msvp = (0.0,) * 3 if attention == "conv" else (1e-3,) * 3
    tc = TrainConfig(epochs=2, batch_size=100, msvp=msvp, device="cpu")
    straight = tmp_path / "a.pt"
    train(cfg, tc, small_digits, straight, progress=False)
    broken = tmp_path / "b.pt"
    with pytest.raises(_Stop):
        train(cfg, tc, small_digits, broken, progress=False, log=_stop_after_first)
    lines: list[str] = []
    summary = train(cfg, tc, small_digits, broken, resume=True, progress=False,
                    log=lines.append)
    assert lines[0].startswith("resuming")
    assert len(summary["history"]) == 2
    assert summary["history"][0]["cpu_seconds"] > 0
    a, b = load_checkpoint(straight), load_checkpoint(broken)
    assert b.config.attention == attention
    for key, value in a.raw["state_dict"].items():
        assert torch.equal(value, b.raw["state_dict"][key]), key


def test_train_cli_attention_option(small_digits, tmp_path) -> None:
    out = tmp_path / "m.pt"
    result = CliRunner().invoke(main, [
        "train", "--attention", "conv", "--epochs", "1", "--embed-dim", "16",
        "--num-heads", "2", "--out", str(out), "--no-progress", "--device", "cpu",
    ])
    assert result.exit_code == 0, result.output
    assert "no W_q, W_k, W_v" in result.output
    assert load_checkpoint(out).config.attention == "conv"
    result = CliRunner().invoke(main, [
        "train", "--attention", "conv", "--msvp", "1e-3", "--epochs", "1",
        "--out", str(tmp_path / "n.pt"), "--no-progress", "--device", "cpu",
    ])
    assert result.exit_code == 1
    assert "MSVP penalises" in result.output and "Traceback" not in result.output


# ------------------------------------------------------------------ analysis


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_analysis_tools_run(attention: str) -> None:
    model = _model(attention)
    x = torch.rand(2, 1, 8, 8, dtype=torch.float64)
    jac = jacobian_spectrum(model, x)
    assert jac.exact and jac.sigma.shape == (2, 2)
    assert bool((jac.l1_linf >= jac.sigma * (1 - 1e-9)).all())  # eq. 16 bound
    spectra = weight_spectra(model)
    assert spectra["W_q"].shape == ((0, 0) if attention == "conv" else (2, 2))
    if attention == "l2":
        assert (spectra["W_q"] == spectra["W_k"]).all()
    res = robust_accuracy(model.float(), x.float(), torch.tensor([0, 1]), ["fgsm"],
                          0.1, "linf")
    assert 0 <= res.robust_accuracy["fgsm"] <= res.clean_accuracy


@pytest.mark.parametrize("attention", VARIANTS)
def test_bounds_refuse_other_attentions(attention: str) -> None:
    model = _model(attention)
    x = torch.rand(2, 1, 8, 8, dtype=torch.float64)
    for call in (
        lambda: network_bound(model, x, "specformer"),
        lambda: network_bound(model, x, "lofast"),
        lambda: layer_tightness(model, x, 0, [0.1]),
        lambda: network_tightness(model, x, [0.1], ["specformer"]),
        lambda: check_crown_support(model),
    ):
        with pytest.raises(UnsupportedModelError, match="dot-product attention") as e:
            call()
        assert "\n" not in str(e.value)

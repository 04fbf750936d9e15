"""Public surface of lipvit, certify and analysis (pinned); certification precision."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

README = Path(__file__).resolve().parent.parent / "README.md"

PUBLIC = {
    "lipvit": [
        "Certified", "Certifier", "Checkpoint", "Dataset", "PRESETS", "TrainConfig",
        "ViT", "ViTConfig",
        "__version__", "ablate_attention", "load_checkpoint", "load_dataset",
        "load_timm", "preset",
        "save_checkpoint", "save_hf", "save_timm", "train", "train_config_for",
        "vit_from_hf", "vit_from_timm",
    ],
    "certify": [
        "Certified", "Certifier", "CertifyReport", "NetworkBound", "TaylorBound",
        "certified_radius",
        "certify_samples", "is_certified", "lofast_bound", "margin", "network_bound",
        "specformer_bound", "taylor_bound",
    ],
    "analysis": [
        "block_jacobian_sigma", "jacobian_spectrum", "layer_tightness",
        "network_tightness", "perturb", "pgd_deviation", "plot_certified_accuracy",
        "plot_jacobian_violin", "plot_spectra", "plot_tightness", "robust_accuracy",
        "save_figure", "weight_spectra",
    ],
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_public_names_are_pinned_and_resolve(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(PUBLIC[package])
    for name in module.__all__:
        value = getattr(module, name)
        if callable(value):
            assert (value.__doc__ or "").strip(), f"{package}.{name} has no docstring"
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def test_no_submodule_takes_a_public_name() -> None:
    """A subpackage named like a public function (``certify.margin``) would
    replace that function on the package once imported."""
    import pkgutil

    import lipvit.analysis
    import lipvit.certify

    for package in (lipvit.certify, lipvit.analysis):
        names = {m.name for m in pkgutil.iter_modules(package.__path__)}
        assert not names & set(package.__all__), package.__name__


def test_public_names_do_not_hide_submodules() -> None:
    import lipvit.analysis.spectrum
    import lipvit.certify.lofast.layer

    assert lipvit.analysis.spectrum.__name__ == "lipvit.analysis.spectrum"
    assert lipvit.certify.lofast.layer.__name__ == "lipvit.certify.lofast.layer"


def test_certification_runs_in_float64_whatever_the_model_dtype(digits) -> None:
    import lipvit.certify

    import lipvit

    torch.manual_seed(0)
    model32 = lipvit.ViT(tiny_config("lipschitz")).eval()
    model64 = lipvit.ViT(tiny_config("lipschitz")).eval()
    model64.load_state_dict(model32.state_dict())
    model64 = model64.double()
    x, y = digits.x_test[:6], digits.y_test[:6]
    b32 = lipvit.certify.network_bound(model32, x)
    b64 = lipvit.certify.network_bound(model64, x.double())
    assert next(model32.parameters()).dtype == torch.float32  # left untouched
    assert b32.logits.dtype == torch.float64
    assert torch.equal(b32.delta_out(0.01), b64.delta_out(0.01))
    r32 = lipvit.certify.certify_samples(model32, x, y, ["lofast"], [0.01], radius=True)
    r64 = lipvit.certify.certify_samples(model64, x, y, ["lofast"], [0.01], radius=True)
    assert torch.equal(r32.radii["lofast"], r64.radii["lofast"])
    assert torch.equal(r32.margins, r64.margins)


def test_certificates_round_in_the_safe_direction() -> None:
    from lipvit.certify.certification import ROUNDING, certified_margin, is_certified

    m = torch.tensor([1.0], dtype=torch.float64)
    # Exactly at the threshold M = √2 δ: not certified, nor just below it.
    delta = m / 2**0.5
    assert not bool(is_certified(m, delta))
    assert not bool(is_certified(m, delta * (1 - ROUNDING / 10)))
    assert bool(is_certified(m, delta * (1 - 10 * ROUNDING)))
    logits = torch.tensor([[1e3, 1e3 - 1.0]], dtype=torch.float64)
    lowered = certified_margin(logits, torch.tensor([0]))
    assert float(lowered) == pytest.approx(1.0 - ROUNDING * 1e3) and lowered < 1.0


def readme_python_quickstart() -> str:
    """The code block of the README's "### Python" quickstart, verbatim."""
    section = README.read_text(encoding="utf-8").split("\n### Python\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _public_names_used(code: str) -> set[tuple[str, str]]:
    """(package, name) for every ``from P import n`` and ``P.n`` of a public
    package ``P`` in ``code``."""
    used = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module in ("lipvit",
                                                                "lipvit.certify"):
            used |= {(node.module, a.name) for a in node.names}
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "lipvit"):
            used.add(("lipvit", node.attr))
    return used


def test_readme_python_quickstart_runs_verbatim(digits, tmp_path, monkeypatch,
                                                capsys) -> None:
    """The README's Python lines, run as they are on a tiny untrained checkpoint
    ``lip.pt``: at most five lines, public names only; the Certifier's tensors
    agree with each other (certified at ε exactly where the radius reaches
    it) and with ``certify_samples``."""
    from lipvit.certify.evaluate import certify_samples

    import lipvit

    code = readme_python_quickstart()
    assert len(code.strip().splitlines()) <= 5
    used = _public_names_used(code)
    assert used, code
    pinned = {"lipvit": PUBLIC["lipvit"], "lipvit.certify": PUBLIC["certify"]}
    assert all(name in pinned[package] for package, name in used), used
    torch.manual_seed(0)
    lipvit.save_checkpoint(tmp_path / "lip.pt", lipvit.ViT(tiny_config("lipschitz")),
                           dataset=digits)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    out, cert = scope["out"], scope["cert"]
    assert cert.method == "taylor"
    assert out.certified.shape == (8, 2) and out.radius.shape == (8,)
    assert torch.equal(out.certified, out.radius[:, None] >= out.eps)
    report = certify_samples(scope["model"], digits.x_test[:8], digits.y_test[:8],
                             ["taylor"], [0.02, 0.05])
    for e, eps in enumerate((0.02, 0.05)):
        assert torch.equal(out.certified[:, e], report.certified[f"taylor@{eps}"])
    assert capsys.readouterr().out.strip()

"""The wheel installs whole: built from the tracked files, installed (not editable)
into a fresh virtual environment, every module imports from it and ``lipvit
certify`` certifies a digits checkpoint with its default method.

The fresh environment reaches this interpreter's third-party packages (torch and
the rest) through a plain path entry, never through a ``.pth`` hook, so the
editable install of the source tree that the other tests use is invisible to it:
a module missing from the wheel is missing there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> the package it installs as (setup.py's mapping).
SOURCES = {"lipvit": "lipvit", "certify": "lipvit.certify",
           "analysis": "lipvit.analysis"}


def source_modules() -> list[str]:
    """Every module of the source tree, by the name it installs under
    (``__main__`` aside: importing it runs the CLI)."""
    names = []
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "__main__.py":
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join([package, *parts]))
    return names


def tracked_copy(dst: Path) -> Path:
    """The files git tracks (what a clean clone has), copied to ``dst``."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                               capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the source tree is not a git checkout")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)
    return dst


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    """``cmd``, failing the test with its output when it fails."""
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                         **kwargs)
    assert out.returncode == 0, f"{cmd[:4]}: {out.stdout}{out.stderr}"
    return out


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel built from the tracked files; returns its bin/."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tracked_copy(tmp / "src")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-q", src, "-w", tmp / "dist"])
    (wheel,) = (tmp / "dist").glob("lipvit-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / ("Scripts" if os.name == "nt" else "bin") / "python"
    purelib = run([python, "-c", "import sysconfig; "
                   "print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    # This interpreter's site dirs as plain entries: their .pth hooks do not run.
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    Path(purelib, "base_packages.pth").write_text("\n".join(deps) + "\n")
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q",
         "--no-deps", "--no-index", wheel])
    return python.parent


def test_every_module_imports_from_the_wheel(installed, tmp_path):
    modules = source_modules()
    assert "lipvit.certify.ball.network" in modules
    script = (
        "import importlib, json, sys\n"
        "files = {m: importlib.import_module(m).__file__ for m in sys.argv[1:]}\n"
        "print(json.dumps(files))\n")
    out = run([installed / "python", "-c", script, *modules], cwd=tmp_path,
              env=clean_env())
    files = json.loads(out.stdout)
    venv_root = installed.parent.resolve()
    outside = [m for m, f in files.items()
               if venv_root not in Path(f).resolve().parents]
    assert not outside, f"imported from outside the installed wheel: {outside}"


def test_installed_cli_certifies_with_the_default_method(installed, tmp_path):
    import torch

    from lipvit.checkpoint import save_checkpoint
    from lipvit.config import preset
    from lipvit.data import load_dataset
    from lipvit.model import ViT

    digits = load_dataset("digits")
    torch.manual_seed(0)
    model = ViT(preset("digits-tiny", family="lipschitz", mean=digits.mean,
                       std=digits.std)).eval()
    ckpt = save_checkpoint(tmp_path / "tiny.pt", model, dataset="digits")
    js = tmp_path / "out.json"
    run([installed / "lipvit", "certify", "--ckpt", ckpt, "--eps", "0.01", "--n", "4",
         "--json", js], cwd=tmp_path, env=clean_env())
    data = json.loads(js.read_text())
    assert data["n"] == 4
    assert [r["method"] for r in data["results"]] == ["taylor"]

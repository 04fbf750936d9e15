"""Fashion-MNIST: idx files made here (gzipped and plain), their errors, the
default directory, class names, the 28×28 preset and schedules, the CLI and the
pipeline's wiring; the real files where Debian's package installed them."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from lipvit import data as D
from lipvit.cli import main
from lipvit.commands.pipeline import build_plan
from lipvit.config import preset
from lipvit.data import load_dataset
from lipvit.errors import DataError
from lipvit.pipeline.steps import Settings
from lipvit.train import FAMILY_DEFAULTS, train_config_for
from tests.test_data import _idx

STEMS = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
REAL = Path("/usr/share/datasets/fashion-mnist")


def _fake(root: Path, compress: bool, n_train: int = 12, n_test: int = 5) -> tuple:
    """Write the four idx files of a tiny Fashion-MNIST into ``root``."""
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, size=(n_train + n_test, 28, 28), dtype=np.uint8)
    labels = (np.arange(n_train + n_test) % 10).astype(np.uint8)
    root.mkdir(parents=True, exist_ok=True)
    arrays = (images[:n_train], labels[:n_train], images[n_train:], labels[n_train:])
    for stem, array in zip(STEMS, arrays, strict=True):
        _idx(root / stem, array, compress)
    return arrays


def _one_line_error(root: Path | None, *phrases: str) -> str:
    with pytest.raises(DataError) as err:
        load_dataset("fashion-mnist", root)
    message = str(err.value)
    assert "\n" not in message
    for phrase in phrases:
        assert phrase in message, message
    return message


@pytest.mark.parametrize("compress", [False, True])
def test_reads_plain_and_gzipped_idx_files(tmp_path: Path, compress: bool) -> None:
    x_train, y_train, x_test, y_test = _fake(tmp_path, compress)
    ds = load_dataset("fashion-mnist", tmp_path)
    assert ds.name == "fashion-mnist" and ds.num_classes == 10
    assert ds.x_train.shape == (12, 1, 28, 28) and ds.x_test.shape == (5, 1, 28, 28)
    assert ds.y_train.tolist() == y_train.tolist()
    assert ds.y_test.tolist() == y_test.tolist()
    assert float(ds.x_test[2, 0, 7, 19]) == pytest.approx(x_test[2, 7, 19] / 255)
    assert ds.augment.flip and ds.augment.pad == 0  # flips only (lipvit.data)


def test_finds_the_dataset_repository_layout(tmp_path: Path) -> None:
    _fake(tmp_path / "data" / "fashion", compress=True)  # a clone of the repository
    assert load_dataset("fashion-mnist", tmp_path).x_train.shape[0] == 12


def test_class_names_in_dataset_and_summary(tmp_path: Path) -> None:
    _fake(tmp_path, compress=False)
    ds = load_dataset("fashion-mnist", tmp_path)
    assert ds.class_names[0] == "T-shirt/top" and ds.class_names[9] == "Ankle boot"
    assert len(set(ds.class_names)) == 10
    assert ds.describe()["class_names"] == list(ds.class_names)
    assert D.class_names("digits", 10) == tuple("0123456789")
    assert D.class_names(None, 3) == ("0", "1", "2")
    assert D.class_names("fashion-mnist", 4) == ("0", "1", "2", "3")  # not its own


def test_default_directory(tmp_path: Path, monkeypatch) -> None:
    _fake(tmp_path / "share", compress=True)
    monkeypatch.setitem(D.DEFAULT_DATA_DIRS, "fashion-mnist", tmp_path / "share")
    assert load_dataset("fashion-mnist").x_test.shape[0] == 5
    monkeypatch.setitem(D.DEFAULT_DATA_DIRS, "fashion-mnist", tmp_path / "absent")
    _one_line_error(
        None,
        "no --data-dir given",
        str(tmp_path / "absent"),
        "apt-get install dataset-fashion-mnist",
        "https://github.com/zalandoresearch/fashion-mnist",
    )


def test_missing_directory_and_files_name_the_package(tmp_path: Path) -> None:
    _one_line_error(
        tmp_path / "nope",
        "does not exist",
        "apt-get install dataset-fashion-mnist",
        "https://github.com/zalandoresearch/fashion-mnist",
    )
    _one_line_error(tmp_path, "train-images-idx3-ubyte[.gz] not found",
                    "apt-get install dataset-fashion-mnist")


def _gz(path: Path) -> Path:
    return path.with_name(path.name + ".gz")


@pytest.mark.parametrize(
    ("case", "phrases"),
    [
        ("labels as images", ("train-images", "magic number 0x00000801",
                              "expected 0x00000803")),
        ("garbage magic", ("t10k-labels", "magic number 0x89504e47")),
        ("truncated", ("t10k-images", "data bytes where shape", "truncated")),
        ("truncated header", ("train-labels", "truncated idx header")),
        ("truncated gzip", ("train-images", "unreadable")),
        ("corrupt gzip", ("t10k-images", "unreadable")),
        ("count mismatch", ("train-images", "12 images but 11 labels")),
        ("test count mismatch", ("t10k-images", "5 images but 6 labels")),
        ("not square", ("t10k-images", "not square")),
        ("label out of range", ("train-labels", "labels outside 0..9")),
    ],
)
def test_malformed_files_are_one_line_errors(
    tmp_path: Path, case: str, phrases: tuple[str, ...]
) -> None:
    x_train, y_train, x_test, y_test = _fake(tmp_path, compress=False)
    files = {stem: tmp_path / stem for stem in STEMS}
    if case == "labels as images":
        _idx(files["train-images-idx3-ubyte"], y_train, False)
    elif case == "garbage magic":
        files["t10k-labels-idx1-ubyte"].write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(8))
    elif case == "truncated":
        path = files["t10k-images-idx3-ubyte"]
        path.write_bytes(path.read_bytes()[:-100])
    elif case == "truncated header":
        files["train-labels-idx1-ubyte"].write_bytes(b"\x00\x00\x08\x01\x00")
    elif case in ("truncated gzip", "corrupt gzip"):
        stem = "train-images-idx3-ubyte" if case == "truncated gzip" else (
            "t10k-images-idx3-ubyte")
        files[stem].unlink()
        _idx(files[stem], x_train if "train" in stem else x_test, True)
        raw = _gz(files[stem]).read_bytes()
        if case == "truncated gzip":
            raw = raw[: len(raw) // 2]
        else:  # keep the gzip header, spoil the deflate stream
            raw = raw[:10] + bytes(b ^ 0x5A for b in raw[10:60]) + raw[60:]
        _gz(files[stem]).write_bytes(raw)
    elif case == "count mismatch":
        _idx(files["train-labels-idx1-ubyte"], y_train[:11], False)
    elif case == "test count mismatch":
        _idx(files["t10k-labels-idx1-ubyte"], np.append(y_test, 1), False)
    elif case == "not square":
        _idx(files["t10k-images-idx3-ubyte"], x_test[:, :, :14], False)
    elif case == "label out of range":
        _idx(files["train-labels-idx1-ubyte"], np.where(y_train == 3, 10, y_train),
             False)
    message = _one_line_error(tmp_path, *phrases)
    assert "malformed" in message and "apt-get install" in message


# ---------------------------------------------------------------- preset, schedule


def test_preset_is_49_patches_plus_the_class_token() -> None:
    for family in ("standard", "lipschitz"):
        cfg = preset("fmnist-3x64", family=family)
        assert (cfg.image_size, cfg.in_chans, cfg.patch_size) == (28, 1, 4)
        assert cfg.num_patches + 1 == 50
        assert (cfg.depth, cfg.embed_dim) == (3, 64)
    # lipschitz: the attention's projection and caps leave the class token a
    # usable norm (LoFAST's radius 1 and caps 0.5 underfit 50 tokens).
    cfg = preset("fmnist-3x64", family="lipschitz")
    assert cfg.attn_radius > 1 and cfg.v_cap * cfg.o_cap > 0.25


def test_lipschitz_preset_is_16_patches_plus_the_class_token() -> None:
    cfg = preset("fmnist-p7-3x128", family="lipschitz")
    assert (cfg.image_size, cfg.patch_size, cfg.num_patches + 1) == (28, 7, 17)
    assert (cfg.depth, cfg.embed_dim) == (3, 128)
    assert cfg.attn_radius > 1 and cfg.v_cap * cfg.o_cap > 0.25


def test_schedules_per_dataset() -> None:
    for family in ("standard", "lipschitz"):
        digits = train_config_for(family, "digits")
        assert digits == train_config_for(family)  # digits: the family defaults
        assert digits.epochs == FAMILY_DEFAULTS[family]["epochs"]
        fmnist = train_config_for(family, "fashion-mnist")
        assert fmnist.batch_size == 128
        # The lipschitz ViT architecture: 20 unaugmented epochs trained for the
        # taylor certificate (ReLU stability 0.2); the standard one: 30 epochs
        # with flips and label smoothing (docs/fashion-mnist.md).
        assert (fmnist.epochs, fmnist.augment) == (
            (30, True) if family == "standard" else (20, False))
        assert fmnist.label_smoothing == (0.1 if family == "standard" else 0.0)
        assert fmnist.relu_stability == (0.0 if family == "standard" else 0.2)
        assert train_config_for(family, "fashion-mnist",
                                relu_stability=0.0).relu_stability == 0.0  # off
        assert fmnist.loss_scale == FAMILY_DEFAULTS[family]["loss_scale"]
        assert train_config_for(family, "fashion-mnist", epochs=3).epochs == 3
    # The hybrid ViT (the lipschitz default on Fashion-MNIST): its own schedule
    # over any dataset's, Lipschitz-margin cross-entropy, no penalties.
    hybrid = train_config_for("lipschitz", "fashion-mnist", arch="hybrid")
    assert hybrid == train_config_for("lipschitz", "digits", arch="hybrid")
    assert (hybrid.epochs, hybrid.batch_size, hybrid.lr) == (20, 256, 1e-3)
    assert hybrid.margin > 0 and hybrid.loss_scale == 4.0
    assert hybrid.relu_stability == 0 and not any(hybrid.msvp)
    assert train_config_for("lipschitz", arch="hybrid", margin=0.0).margin == 0.0
    # CaiT (the lipschitz default on Fashion-MNIST): trained for ball at 0.1.
    cait = train_config_for("lipschitz", "fashion-mnist", arch="cait")
    assert (cait.epochs, cait.batch_size, cait.cert_eps) == (12, 256, 0.1)
    assert cait.relu_stability == 0 and not any(cait.msvp) and not cait.augment


# ---------------------------------------------------------------- CLI and pipeline


def test_cli_train_defaults_to_the_fashion_mnist_preset(tmp_path: Path) -> None:
    _fake(tmp_path / "data", compress=True)
    out = tmp_path / "m.pt"
    result = CliRunner().invoke(main, [
        "train", "--dataset", "fashion-mnist", "--data-dir", str(tmp_path / "data"),
        "--depth", "1", "--epochs", "1", "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, result.output
    from lipvit.checkpoint import load_checkpoint

    ckpt = load_checkpoint(out)
    assert ckpt.dataset == "fashion-mnist"
    assert (ckpt.config.patch_size, ckpt.config.embed_dim) == (4, 64)
    assert ckpt.summary["train_config"]["batch_size"] == 128
    assert ckpt.summary["dataset"]["class_names"][9] == "Ankle boot"
    result = CliRunner().invoke(main, [
        "train", "--dataset", "fashion-mnist", "--data-dir", str(tmp_path / "data"),
        "--family", "lipschitz", "--depth", "1", "--epochs", "1", "--no-progress",
        "--out", str(tmp_path / "lip.pt")])
    assert result.exit_code == 0, result.output
    lip = load_checkpoint(tmp_path / "lip.pt")
    assert (lip.config.arch, lip.config.embed_dim) == ("hybrid", 64)  # fmnist-hybrid
    assert lip.summary["train_config"]["batch_size"] == 256
    assert lip.summary["proven"]["arch"] == "hybrid"
    assert "global constant" in result.output and "without attention" in result.output


@pytest.mark.parametrize("command", [
    ["train", "--epochs", "1", "--out", "{tmp}/m.pt"],
    ["pipeline", "--out", "{tmp}/run", "--fast"],
])
def test_cli_missing_directory_is_one_line(tmp_path: Path, command: list) -> None:
    argv = [a.format(tmp=tmp_path) for a in command]
    result = CliRunner().invoke(main, [*argv, "--dataset", "fashion-mnist",
                                       "--data-dir", str(tmp_path / "nope")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("Error") and "dataset-fashion-mnist" in lines[-1]
    assert not (tmp_path / "run").exists()  # the pipeline refuses before any job


def test_pipeline_selects_the_fashion_mnist_preset_and_schedules(
    tmp_path: Path,
) -> None:
    full = Settings.for_dataset("fashion-mnist")
    for settings in (full, Settings.fast_mode("fashion-mnist")):
        plan = build_plan(tmp_path, settings, dataset="fashion-mnist")
        trains = [step for step in plan.steps if step.train]
        assert [s.key for s in trains] == ["train/vanilla", "train/msvp",
                                           "train/lipschitz"]
        for step in trains:
            args = list(step.args)
            assert args[args.index("--dataset") + 1] == "fashion-mnist"
            assert "--preset" not in args  # `lipvit train` picks the presets
            assert "--init" not in args  # every model in one command
        # The lipschitz model is CaiT: no MSVP, certified by `ball` and
        # `global` only, and no LoFAST tightness or CROWN steps on it.
        lip = list(trains[-1].args)
        assert lip[lip.index("--msvp") + 1] == "0"
        cert = list(next(s for s in plan.steps if s.key == "certify/lipschitz").args)
        assert cert[cert.index("--method") + 1] == "ball,global"
        keys = {s.key for s in plan.steps}
        assert not keys & {"tightness/layer", "tightness/layer-residual",
                           "tightness/network", "tightness/margin-lipschitz",
                           "certify/lipschitz-crown"}
        assert {"tightness/layer-vanilla", "tightness/margin-msvp", "attack/radius",
                "plot/gap"} <= keys
        epochs = [s.args[s.args.index("--epochs") + 1] for s in trains
                  if "--epochs" in s.args]
        assert epochs == ([] if settings == full else ["1"] * 3)
    assert Settings.fast_mode().preset == "digits-smoke"  # digits: as before
    assert Settings.for_dataset("digits") == Settings()
    digits = build_plan(tmp_path, Settings(), dataset="digits")
    assert len([s for s in digits.steps if s.train]) == 3
    assert "tightness/network" in {s.key for s in digits.steps}
    attack = next(step for step in build_plan(tmp_path, full, dataset="fashion-mnist")
                  .steps if step.key == "attack/lipschitz")
    args = list(attack.args)  # real images: the literature's l2 radii, with APGD
    assert args[args.index("--eps") + 1] == "0.1,0.25,0.5,1.0"
    assert "apgd" in args[args.index("--attack") + 1].split(",")


def test_pipeline_trains_and_certifies_the_hybrid(tmp_path: Path) -> None:
    """The Fashion-MNIST pipeline's lipschitz steps on a tiny fake dataset:
    one `lipvit train` (the hybrid ViT, no MSVP), certified with `ball` and `global`,
    whose report section names the methods and the model's constant."""
    import json

    from lipvit.analysis.report import pipeline_report

    from lipvit.checkpoint import load_checkpoint
    from lipvit.pipeline.scheduler import run_step

    _fake(tmp_path / "data", compress=False)
    plan = build_plan(tmp_path / "run", Settings.fast_mode("fashion-mnist"),
                      dataset="fashion-mnist", data_dir=tmp_path / "data",
                      device="cpu", threads=1)
    steps = {s.key: s for s in plan.steps}
    assert run_step(steps["train/lipschitz"], False) == "ran"
    assert run_step(steps["certify/lipschitz"], False) == "ran"
    ckpt = load_checkpoint(plan.model("lipschitz"))
    assert ckpt.config.arch == "hybrid"
    assert not any(ckpt.summary["train_config"]["msvp"])
    cert = json.loads((plan.out / "certify" / "lipschitz.json").read_text())
    assert {r["method"] for r in cert["results"]} == {"ball", "global"}
    report = pipeline_report(plan.out, {}, {}).render()
    assert "`global`: bounds each class pair's margin" in report
    assert "`ball`: " in report
    assert "The lipschitz model is the hybrid ViT" in report


@pytest.mark.skipif(not REAL.is_dir(), reason=f"{REAL} absent "
                    "(apt-get install dataset-fashion-mnist)")
def test_real_files() -> None:
    # The idx arrays only (uint8, 55 MB), not the float tensors of load_dataset.
    paths = D._find_idx(REAL, "fashion-mnist", ())
    x_train, y_train, x_test, y_test = (
        D._read_idx(p, "fashion-mnist", ndim)
        for p, ndim in zip(paths, (3, 1, 3, 1), strict=True)
    )
    assert x_train.shape == (60000, 28, 28) and x_test.shape == (10000, 28, 28)
    assert np.bincount(y_train).tolist() == [6000] * 10
    assert np.bincount(y_test).tolist() == [1000] * 10
    assert D.CLASS_NAMES["fashion-mnist"][y_train[0]] == "Ankle boot"
    with gzip.open(paths[1]) as f:
        assert f.read(4) == b"\x00\x00\x08\x01"


def test_tsne_legend_shows_class_names() -> None:
    from lipvit.analysis.plots import plot_tsne

    emb = np.random.default_rng(0).normal(size=(20, 2))
    labels = np.array([0, 9] * 10)
    fig = plot_tsne(emb, labels, np.arange(20) >= 10, color_by="class",
                    class_names=D.CLASS_NAMES["fashion-mnist"])
    legend = fig.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["T-shirt/top", "Ankle boot"]

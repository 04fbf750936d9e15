"""``lipvit features``: t-SNE and A-distance of clean versus attacked features."""

from __future__ import annotations

from pathlib import Path

import click

from lipvit.analysis.attacks import ATTACKS
from lipvit.commands import _common as C

FILES = ("tsne.png", "features.json", "tsne.csv")


@click.command("features")
@C.ckpt_option()
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="output folder (tsne.png, features.json, tsne.csv)")
@click.option("--attack", "attack_name", default="pgd", show_default=True,
              help=f"one of {', '.join(ATTACKS)}")
@click.option("--eps", "eps_text", default="8/255", show_default=True,
              help="attack radius in image units")
@click.option("--norm", type=click.Choice(["linf", "l2"]), default="linf",
              show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--color-by", type=click.Choice(["source", "class"]), default="source",
              show_default=True, help="t-SNE colours: clean/attacked, or class")
@click.option("--n", "n", type=click.IntRange(min=4), default=500, show_default=True,
              help="test samples (a fixed seeded subsample)")
@C.batch_size_option
@C.device_option
@C.data_options
@C.pdf_option
@C.force_option
@C.threads_option
def features(ckpt: Path, out: Path, attack_name: str, eps_text: str, norm: str,
             steps: int, seed: int, color_by: str, n: int, batch_size: int, device: str,
             dataset: str | None, data_dir: Path | None, pdf: bool,
             force: bool) -> None:
    """t-SNE of penultimate features of clean and attacked test points, with
    the proxy A-distance between the two sets (SpecFormer Fig. 2b-c)."""
    from lipvit.analysis.features import (
        feature_shift,  # sklearn, matplotlib: slow imports
    )
    from lipvit.analysis.plots import plot_tsne, save_figure

    name = C.parse_names(attack_name, ATTACKS, "attack")
    if len(name) != 1:
        raise ValueError("--attack takes one attack")
    eps = C.parse_floats(eps_text, "eps")
    if len(eps) != 1:
        raise ValueError("--eps takes one radius")
    paths = [out / f for f in FILES] + ([out / "tsne.pdf"] if pdf else [])
    C.check_writable(paths, force)

    ck = C.load_checkpoint(ckpt, device)
    C.check_vit(ck, "lipvit features")
    data = C.load_test_set(ck, n=n, dataset=dataset, data_dir=data_dir, device=device)
    shift = feature_shift(ck.model, data.x, data.y, attack=name[0], eps=eps[0],
                          norm=norm, seed=seed, steps=steps, batch_size=batch_size)
    label = f"{name[0]} ε={C.format_eps(eps[0])} ({'ℓ∞' if norm == 'linf' else 'ℓ2'})"
    out.mkdir(parents=True, exist_ok=True)
    fig = plot_tsne(shift.embedding, list(shift.labels) * 2, shift.attacked_mask,
                    a_distance=shift.a_distance.a_distance, color_by=color_by,
                    attacked_label=label, title=f"{ckpt.name}: clean vs {label}",
                    class_names=data.class_names)
    save_figure(fig, out / "tsne.png", pdf, force=force)

    n_samples = len(shift.labels)
    ad = shift.a_distance
    C.write_json(out / "features.json", {
        "checkpoint": str(ckpt), "dataset": data.dataset, "n": n_samples,
        "attack": name[0], "eps": eps[0], "norm": norm, "settings": shift.settings,
        "a_distance": ad.a_distance, "domain_classifier_error": ad.error,
        "domain_classifier_n_train": ad.n_train, "domain_classifier_n_test": ad.n_test,
        "clean_accuracy": shift.clean_accuracy,
        "attacked_accuracy": shift.attacked_accuracy,
        "counts": {"clean": n_samples, "attacked": n_samples},
        "feature_dim": int(shift.clean.shape[1])}, force=force)
    C.write_csv(out / "tsne.csv", shift.to_records(data.index), force=force)
    click.echo(f"{ckpt}: {data.dataset}, n={n_samples}, {label}")
    click.echo(C.format_table(
        ["A-distance", "domain error", "clean accuracy", "attacked accuracy"],
        [[f"{ad.a_distance:.4f}", f"{ad.error:.4f}", f"{shift.clean_accuracy:.4f}",
          f"{shift.attacked_accuracy:.4f}"]]))
    click.echo(f"wrote {', '.join(str(p) for p in paths)}")

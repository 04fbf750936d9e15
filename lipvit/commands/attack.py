"""``lipvit attack``: robust accuracy under torchattacks attacks (empirical ceiling)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from analysis.attacks import (
    ATTACK_PRESETS,
    ATTACKS,
    AttackResult,
    resolve_settings,
    robust_accuracy,
)
from lipvit.commands import _common as C

WORST = "worst-case"


def _rows(result: AttackResult, n: int) -> list[dict]:
    rows = [{"attack": name, "norm": result.norm, "eps": result.eps,
             "robust_accuracy": acc, "n": n,
             "seconds_per_sample": result.seconds[name] / max(n, 1),
             "rejected": result.rejected[name]}
            for name, acc in result.robust_accuracy.items()]
    rows.append({"attack": WORST, "norm": result.norm, "eps": result.eps,
                 "robust_accuracy": result.worst_case_accuracy, "n": n,
                 "seconds_per_sample": sum(result.seconds.values()) / max(n, 1),
                 "rejected": sum(result.rejected.values())})
    return rows


def _samples(results: list[AttackResult], index) -> list[dict]:
    # Per test sample: correct after each attack at each eps ("<attack>@<eps>").
    first = results[0]
    samples = []
    for i in range(first.n):
        correct = {f"{a}@{r.eps}": bool(r.correct[a][i])
                   for r in results for a in r.attacks}
        correct.update({f"{WORST}@{r.eps}": bool(r.worst_case[i]) for r in results})
        samples.append({"index": int(index[i]), "label": int(first.labels[i]),
                        "prediction": int(first.clean_prediction[i]),
                        "correct": correct})
    return samples


@click.command("attack")
@C.ckpt_option()
@click.option("--attack", "attack_names", default=None,
              help=f"comma-separated attacks: {', '.join(ATTACKS)} "
                   "(default: pgd, or pgd-l2 with --norm l2)")
@click.option("--eps", "eps_text", multiple=True,
              help="radius or comma list, e.g. 0.5 or 2/255,8/255 (repeatable)")
@click.option("--norm", type=click.Choice(["linf", "l2"]), default=None,
              help="threat model (default: linf, or the preset's)")
@click.option("--preset", type=click.Choice(list(ATTACK_PRESETS)), default=None,
              help="attack settings of a SpecFormer table; explicit options override")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="iterations of pgd, pgd-l2, cw-pgd, cw (default 20; cw 100)")
@click.option("--alpha", "alpha_text", default=None,
              help="step size (default 2.5·eps/steps), e.g. 2/255")
@click.option("--restarts", type=click.IntRange(min=1), default=None,
              help="random restarts of pgd, pgd-l2, cw-pgd (default 1)")
@click.option("--seed", type=int, default=0, show_default=True)
@C.n_option
@C.batch_size_option
@C.device_option
@C.data_options
@C.json_option
@C.csv_option
@C.force_option
def attack(ckpt: Path, attack_names: str | None, eps_text: tuple[str, ...],
           norm: str | None, preset: str | None, steps: int | None,
           alpha_text: str | None, restarts: int | None, seed: int, n: int | None,
           batch_size: int, device: str, dataset: str | None, data_dir: Path | None,
           json_path: Path | None, csv_path: Path | None, force: bool) -> None:
    """Robust accuracy per attack and the per-sample worst case over attacks.

    An attack finds adversarial points but proves nothing: these accuracies are
    upper bounds of the true robust accuracy (certified accuracy is a lower
    bound). Images are in [0, 1]; eps is in those units.
    """
    C.check_writable([json_path, csv_path], force)
    spec = ATTACK_PRESETS[preset] if preset else None
    norm = norm or (spec.norm if spec else "linf")
    if attack_names:
        names = C.parse_names(attack_names, ATTACKS, "attack")
    else:
        names = list(spec.attacks) if spec else ["pgd-l2" if norm == "l2" else "pgd"]
    if eps_text:
        eps_list = C.parse_floats(eps_text, "eps")
    elif spec:
        eps_list = [spec.eps]
    else:
        raise ValueError("give --eps (or a --preset)")
    settings = dict(spec.settings) if spec else {}
    alpha = C.parse_floats(alpha_text, "alpha")[0] if alpha_text else None
    overrides = {"steps": steps, "restarts": restarts, "seed": seed,
                 "batch_size": batch_size, "alpha": alpha}
    settings.update({k: v for k, v in overrides.items() if v is not None})
    resolve_settings(names, norm, **settings)  # fail before loading anything

    ck = C.load_checkpoint(ckpt, device)
    data = C.load_test_set(ck, n=n, dataset=dataset, data_dir=data_dir, device=device)
    n_samples = int(data.y.shape[0])
    results = [robust_accuracy(ck.model, data.x, data.y, names, eps, norm,
                               progress=sys.stderr.isatty(), **settings)
               for eps in eps_list]

    rows = [row for r in results for row in _rows(r, n_samples)]
    clean = results[0].clean_accuracy
    click.echo(f"{ckpt}: {data.dataset}, n={n_samples}, clean accuracy {clean:.4f}, "
               f"threat model {norm}")
    click.echo(C.format_table(
        ["attack", "eps", "robust accuracy", "s/sample"],
        [[r["attack"], C.format_eps(r["eps"]), f"{r['robust_accuracy']:.4f}",
          r["seconds_per_sample"]] for r in rows]))
    rejected = {r["attack"]: r["rejected"] for r in rows
                if r["rejected"] and r["attack"] not in ("cw", WORST)}
    if rejected:  # a torchattacks bug: points outside the ball were discarded
        click.echo(f"warning: points outside the threat model discarded: {rejected}",
                   err=True)

    if json_path:
        C.write_json(json_path, {
            "checkpoint": str(ckpt), "dataset": data.dataset, "n": n_samples,
            "norm": norm, "preset": preset, "attacks": names,
            "clean_accuracy": clean, "settings": results[0].settings,
            "results": rows, "samples": _samples(results, data.index)}, force=force)
    if csv_path:
        C.write_csv(csv_path, rows, force=force)

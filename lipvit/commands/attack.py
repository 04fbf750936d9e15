"""``lipvit attack``: robust accuracy under torchattacks attacks (empirical ceiling);
with ``--radius``, each sample's smallest adversarial ℓ2 radius by bisection."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from lipvit.analysis.attack_radius import (
    RADIUS_ATTACKS,
    RadiusSettings,
    attack_radius,
    summary,
)
from lipvit.analysis.attacks import (
    ATTACK_PRESETS,
    ATTACKS,
    WORST,
    resolve_settings,
    robust_accuracy,
    sample_records,
)
from lipvit.commands import _common as C

RADIUS_QUANTITIES = {
    "radius": "upper bound of the smallest adversarial l2 radius: the verified "
              "distance of an adversarial point (0: misclassified; null: none found)",
    "bracket_low": "largest eps at which every attack failed (not a bound)",
    "first_order_limit": "estimate, not a bound: min_j margin_j / ||grad_x margin_j||",
}


def _radius_mode(ckpt: Path, names: list[str], settings: RadiusSettings, n: int | None,
                 device: str, dataset: str | None, data_dir: Path | None,
                 json_path: Path | None, csv_path: Path | None, force: bool) -> None:
    from tqdm.auto import tqdm

    ck = C.load_checkpoint(ckpt, device)
    model = ck.model.double()  # the model `lipvit certify` certifies
    data = C.load_test_set(ck, n=n, dataset=dataset, data_dir=data_dir, device=device)
    with tqdm(total=int(data.y.shape[0]), desc="attack radius", unit="sample",
              leave=False, disable=not sys.stderr.isatty()) as bar:
        def progress(done: int, step: int) -> None:
            bar.n = done
            bar.set_postfix(bisection_step=step)
            bar.refresh()

        result = attack_radius(model, data.x.double(), data.y, settings, progress)
    info = summary(result)
    click.echo(f"{ckpt}: {data.dataset}, n={result.n}, clean accuracy "
               f"{info['clean_accuracy']:.4f}, smallest adversarial l2 radius, "
               f"worst case over {', '.join(names)}")
    click.echo(C.format_table(
        ["samples with a radius", "median attack radius (upper bound)",
         "median first-order limit (estimate)", "s/sample"],
        [[info["n_radius"], info["median_radius"], info["median_first_order"],
          info["seconds_per_sample"]]]))
    click.echo("closest point found by: " + ", ".join(
        f"{a} {k}" for a, k in info["closest_by_attack"].items()))
    if info["n_not_found"]:
        click.echo(f"warning: no adversarial point found for {info['n_not_found']} "
                   f"samples up to radius {result.settings['max_radius']:.4g}",
                   err=True)
    if not info["all_verified"]:  # a bug: every kept point is re-checked
        raise AssertionError("an adversarial point failed its re-check")
    samples = result.to_records(data.index)
    if json_path:
        C.write_json(json_path, {
            "checkpoint": str(ckpt), "dataset": data.dataset, "n": result.n,
            "norm": "l2", "attacks": names, "clean_accuracy": info["clean_accuracy"],
            "settings": result.settings, "quantities": RADIUS_QUANTITIES,
            "summary": info, "samples": samples}, force=force)
    if csv_path:
        C.write_csv(csv_path, samples, force=force)


@click.command("attack")
@C.ckpt_option()
@click.option("--attack", "attack_names", default=None,
              help=f"comma-separated attacks: {', '.join(ATTACKS)} "
                   "(default: pgd, or pgd-l2 with --norm l2); with --radius: "
                   f"{', '.join(RADIUS_ATTACKS)} (default: all)")
@click.option("--eps", "eps_text", multiple=True,
              help="radius or comma list, e.g. 0.5 or 2/255,8/255 (repeatable)")
@click.option("--norm", type=click.Choice(["linf", "l2"]), default=None,
              help="threat model (default: linf, or the --threat's)")
@click.option("--threat", "preset", type=click.Choice(list(ATTACK_PRESETS)),
              default=None,
              help="attack settings of a SpecFormer table; explicit options override")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="iterations of pgd, pgd-l2, cw-pgd, cw (default 20; cw 100); "
                   "--radius: of pgd-l2, apgd, apgd-t (default 50)")
@click.option("--step-size", "alpha_text", default=None,
              help="step size (default 2.5·eps/steps), e.g. 2/255")
@click.option("--restarts", type=click.IntRange(min=1), default=None,
              help="random restarts of pgd, pgd-l2, cw-pgd (default 1); --radius: "
                   "of pgd-l2, apgd (default 2)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--radius", is_flag=True,
              help="instead: each sample's smallest adversarial l2 radius (bisection "
                   f"on eps, worst case over {', '.join(RADIUS_ATTACKS)} by default)")
@click.option("--radius-tol", "radius_tol_text", default=None,
              help="--radius: relative bisection tolerance  [default: 0.01]")
@click.option("--max-radius", "max_radius_text", default=None,
              help="--radius: largest radius searched  [default: the box diagonal]")
@C.n_option
@C.batch_size_option
@C.device_option
@C.data_options
@C.json_option
@C.csv_option
@C.force_option
@C.threads_option
@C.results_to_stdout
def attack(ckpt: Path, attack_names: str | None, eps_text: tuple[str, ...],
           norm: str | None, preset: str | None, steps: int | None,
           alpha_text: str | None, restarts: int | None, seed: int, radius: bool,
           radius_tol_text: str | None, max_radius_text: str | None, n: int | None,
           batch_size: int, device: str, dataset: str | None, data_dir: Path | None,
           json_path: Path | None, csv_path: Path | None, force: bool) -> None:
    """Robust accuracy per attack and the per-sample worst case over attacks.

    An attack finds adversarial points but proves nothing: these accuracies are
    upper bounds of the true robust accuracy (certified accuracy is a lower
    bound). Images are in [0, 1]; eps is in those units.

    With --radius: per sample, the verified distance of the closest adversarial
    point found by bisection on eps (an upper bound of the true robust radius),
    and the first-order limit min_j margin_j/||grad margin_j|| (an estimate).
    """
    C.check_results([json_path, csv_path], force)
    if radius:
        given = {"--eps": eps_text, "--threat": preset, "--step-size": alpha_text,
                 "--norm linf": norm == "linf"}
        clash = [k for k, v in given.items() if v]
        if clash:
            raise ValueError(f"--radius searches eps itself (l2): drop {clash[0]}")
        names = (C.parse_names(attack_names, RADIUS_ATTACKS, "attack")
                 if attack_names else list(RADIUS_ATTACKS))
        tuning = {"steps": steps, "restarts": restarts}
        tuning = {k: v for k, v in tuning.items() if v is not None}
        if radius_tol_text:
            tuning["rtol"] = C.parse_floats(radius_tol_text, "radius tolerance")[0]
        if max_radius_text:
            tuning["max_radius"] = C.parse_floats(max_radius_text, "max radius")[0]
        settings = RadiusSettings(attacks=tuple(names), seed=seed,
                                  batch_size=batch_size, **tuning)
        _radius_mode(ckpt, names, settings, n, device, dataset, data_dir, json_path,
                     csv_path, force)
        return
    if radius_tol_text or max_radius_text:
        raise ValueError("--radius-tol and --max-radius need --radius")
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
        raise ValueError("give --eps (or a --threat)")
    settings = dict(spec.settings) if spec else {}
    alpha = C.parse_floats(alpha_text, "step-size")[0] if alpha_text else None
    overrides = {"steps": steps, "restarts": restarts, "seed": seed,
                 "batch_size": batch_size, "alpha": alpha}
    settings.update({k: v for k, v in overrides.items() if v is not None})
    resolve_settings(names, norm, **settings)  # fail before loading anything

    ck = C.load_checkpoint(ckpt, device)
    data = C.load_test_set(ck, n=n, dataset=dataset, data_dir=data_dir, device=device)
    n_samples = int(data.y.shape[0])
    if norm == "l2":  # an ℓ∞ ball of radius ≥ 1 holds every image; ℓ2: the diameter
        C.warn_large_eps(eps_list, data.x.shape[1:])
    results = [robust_accuracy(ck.model, data.x, data.y, names, eps, norm,
                               progress=sys.stderr.isatty(), **settings)
               for eps in eps_list]

    rows = [row for r in results for row in r.to_records()]
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
            "results": rows, "samples": sample_records(results, data.index)},
            force=force)
    if csv_path:
        C.write_csv(csv_path, rows, force=force)

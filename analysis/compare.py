"""SpecFormer's comparison of robust attentions, on one dataset and preset.

One model per (attention, MSVP on/off) of :data:`lipvit.config.ATTENTIONS`
(``conv`` has no W_q, W_k, W_v, hence no MSVP run), each trained by
:func:`lipvit.train.train` and evaluated the same way:

- clean accuracy and robust accuracy under FGSM, PGD and AutoAttack
  (:func:`lipvit.analysis.attacks.robust_accuracy`) at the chosen ℓ∞ and ℓ2 radii,
  SpecFormer Tables 2–4 in shape (robust accuracies are **upper bounds** of
  the true ones: an attack only finds adversarial points);
- training seconds per epoch, wall (from the training history) and CPU
  (process time around the training call), and their ratios to vanilla
  (``dot`` without MSVP) — SpecFormer reports 1.5× for MSVP;
- the mean exact σ_max of ``W_q``, ``W_k``, ``W_v`` (dense SVD);
- σ_max of every block's residual-branch Jacobian at clean test points
  (:func:`lipvit.analysis.spectrum.jacobian_spectrum`; exact at small sizes), the
  Cauchy-problem paper's Fig. 3 as one line per model;
- certified accuracy (LoFAST network bound, ℓ2) where a certificate exists:
  dot-product attention only; the others record the one-line refusal.

:func:`run_compare` trains or reuses the models under ``out/models/`` (an
unfinished checkpoint resumes, a finished one is reused; an evaluation is
cached in ``<name>.eval.json`` and redone when its checkpoint is newer) and
returns a :class:`Comparison`; :func:`write_report` writes the CSV, JSON,
PNG and markdown files. Settings are stored in ``out/settings.json``: other
training settings (:data:`TRAIN_KEYS`) for the same ``out`` are refused unless
``force`` (which retrains everything); other evaluation settings redo the
evaluations (announced per model). AutoAttack is opt-in and runs on the first
``n_autoattack`` attacked images: its cost is mostly per call (about a minute
of CPU per model and radius on digits), not per image.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lipvit.certify.eps import check_eps_list

from lipvit.config import ATTENTIONS, PRESETS, preset
from lipvit.errors import LipvitError, UnsupportedModelError
from lipvit.files import write_json

Log = Callable[[str], None]
#: Settings that shape the trained models: another value for the same ``out`` is
#: refused (``force`` retrains). The others only change the evaluation, which
#: is redone (per model, announced in the log) when they change.
TRAIN_KEYS = ("dataset", "preset", "msvp", "epochs", "seed")
FILES = ("compare.csv", "compare.json", "jacobian.png", "accuracy.png", "report.md")


@dataclass(frozen=True)
class CompareSettings:
    """What ``lipvit compare`` trains and measures (saved as ``settings.json``)."""

    dataset: str = "digits"
    preset: str = "digits-tiny"
    attentions: tuple[str, ...] = ATTENTIONS
    msvp: float = 1e-3
    epochs: int = 15
    seed: int = 0
    eps_linf: tuple[float, ...] = (2 / 255, 8 / 255)
    eps_l2: tuple[float, ...] = (0.1, 0.5)
    n_attack: int = 200
    attack_steps: int = 10
    autoattack: bool = False
    n_autoattack: int = 25
    n_jacobian: int = 16
    fast: bool = False

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(
                f"unknown preset {self.preset!r}; choose from {', '.join(PRESETS)}"
            )
        if not self.attentions:
            raise ValueError("give at least one attention")
        for a in self.attentions:
            if a not in ATTENTIONS:
                raise ValueError(
                    f"unknown attention {a!r}; choose from {', '.join(ATTENTIONS)}"
                )
        if "dot" not in self.attentions:
            raise ValueError("the comparison needs 'dot' (the vanilla reference)")
        if len(set(self.attentions)) != len(self.attentions):
            raise ValueError(f"attention listed twice: {list(self.attentions)}")
        if not (math.isfinite(self.msvp) and self.msvp > 0):
            raise ValueError(f"msvp must be > 0 (the MSVP runs), got {self.msvp}")
        for name in ("epochs", "n_attack", "attack_steps", "n_autoattack",
                     "n_jacobian"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("eps_linf", "eps_l2"):
            values = check_eps_list(getattr(self, name), name=name)
            object.__setattr__(self, name, tuple(values.tolist()))
        object.__setattr__(self, "attentions", tuple(self.attentions))

    @classmethod
    def fast_mode(cls, **overrides: Any) -> CompareSettings:
        """A smoke run: one epoch, a few samples, 2 PGD steps (seconds)."""
        base = dict(epochs=1, n_attack=16, attack_steps=2, n_autoattack=4,
                    n_jacobian=2, fast=True)
        return cls(**{**base, **overrides})

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for k in ("attentions", "eps_linf", "eps_l2"):
            out[k] = list(out[k])
        return out

    def evaluation(self) -> dict[str, Any]:
        """The settings an evaluation depends on (stored with its cache)."""
        d = self.to_dict()
        return {k: v for k, v in d.items() if k not in TRAIN_KEYS + ("attentions",)}


@dataclass(frozen=True)
class Run:
    """One model of the comparison."""

    attention: str
    msvp: bool

    @property
    def name(self) -> str:
        return self.attention + ("-msvp" if self.msvp else "")


def runs(settings: CompareSettings) -> tuple[list[Run], list[str]]:
    """The models to train, and notes on the (attention, MSVP) pairs left out."""
    out, notes = [], []
    for a in settings.attentions:
        out.append(Run(a, False))
        if a == "conv":
            notes.append(
                "conv + MSVP left out: CoViT's token mixing has no W_q, W_k, W_v "
                "for MSVP to penalise"
            )
        else:
            out.append(Run(a, True))
    return out, notes


@dataclass
class Comparison:
    """Everything :func:`write_report` writes (plain data, JSON-ready)."""

    settings: CompareSettings
    rows: list[dict[str, Any]]
    jacobian: dict[str, list[float]]
    notes: list[str]
    seconds: dict[str, float] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ settings


def check_settings(out: Path, settings: CompareSettings, force: bool) -> None:
    """Refuse ``out`` trained with other :data:`TRAIN_KEYS` unless ``force``.

    Raises:
        LipvitError: ``out/settings.json`` holds other training settings (the
            message names the differing keys).
    """
    path = out / "settings.json"
    mine = settings.to_dict()
    if path.exists() and not force:
        saved = json.loads(path.read_text())
        diff = [k for k in TRAIN_KEYS if saved.get(k) != mine.get(k)]
        if diff:
            raise LipvitError(
                f"{out} holds models trained with other settings "
                f"({', '.join(diff)}); pass --force to retrain them or choose "
                "another --out"
            )
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, mine, force=True)


# ------------------------------------------------------------------ training


def train_run(
    run: Run,
    settings: CompareSettings,
    data,
    models: Path,
    *,
    force: bool,
    progress: bool,
    log: Log,
) -> dict[str, Any]:
    """Train (or resume, or reuse) ``run``; returns its training summary."""
    from lipvit.checkpoint import load_checkpoint
    from lipvit.train import train, train_config_for

    cfg = preset(
        settings.preset,
        attention=run.attention,
        image_size=data.image_size,
        in_chans=data.in_chans,
        num_classes=data.num_classes,
        mean=data.mean,
        std=data.std,
    )
    lam = settings.msvp if run.msvp else 0.0
    tcfg = train_config_for(
        "standard", epochs=settings.epochs, msvp=(lam,) * 3, seed=settings.seed,
        device="cpu",
    )
    ckpt = models / f"{run.name}.pt"
    if not force and ckpt.exists():
        # A finished run with these very settings is reused as it is (calling
        # train() again would rewrite the file and invalidate its evaluation).
        summary = load_checkpoint(ckpt).summary
        if summary is not None and (
            summary.get("model_config"), summary.get("train_config")
        ) == (cfg.to_dict(), tcfg.to_dict()):
            log(f"{run.name}: trained model reused ({ckpt})")
            return summary
    return train(
        cfg, tcfg, data, ckpt, resume=not force, force=force, progress=progress,
        log=lambda line: log(f"{run.name}: {line}"),
    )


# ------------------------------------------------------------------ evaluation


def evaluate_run(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
    settings: CompareSettings, log: Log,
) -> dict[str, Any]:
    """Attacks, Jacobian spectrum and certificate of one trained model.

    Returns plain data: ``clean``; ``robust`` (key ``"<norm> <eps> <attack>"``
    → accuracy); ``jacobian`` (per-block mean and std of σ_max(J_F) over the
    first ``n_jacobian`` samples, exact or a power-iteration estimate from
    below, as ``jacobian_method`` says); ``certified`` (key ``"l2 <eps>"``)
    or ``certified_note`` with the refusal; ``seconds`` per part.
    """
    from lipvit.analysis.attacks import robust_accuracy
    from lipvit.analysis.spectrum import jacobian_spectrum
    from lipvit.certify.evaluate import certify_samples

    model.eval()
    seconds: dict[str, float] = {}
    robust: dict[str, float] = {}
    clean = None
    plans = [("linf", e, ["fgsm", "pgd"]) for e in settings.eps_linf]
    plans += [("l2", e, ["pgd-l2"]) for e in settings.eps_l2]
    n_aa = settings.n_autoattack
    for norm, eps, attacks in plans:
        log(f"attacks {norm} eps={eps:.4g}: {', '.join(attacks)}")
        t0 = time.perf_counter()
        res = robust_accuracy(
            model, x, y, attacks, eps, norm, steps=settings.attack_steps,
            seed=settings.seed,
        )
        seconds[f"attack {norm} {eps:g}"] = time.perf_counter() - t0
        clean = res.clean_accuracy
        for name, acc in res.robust_accuracy.items():
            robust[f"{norm} {eps:g} {name}"] = acc
        if settings.autoattack:
            # Its cost is mostly per call, not per image: a fixed subset.
            log(f"autoattack {norm} eps={eps:.4g} on {min(n_aa, len(x))} images")
            t0 = time.perf_counter()
            res = robust_accuracy(model, x[:n_aa], y[:n_aa], ["autoattack"], eps,
                                  norm, seed=settings.seed)
            seconds[f"autoattack {norm} {eps:g}"] = time.perf_counter() - t0
            robust[f"{norm} {eps:g} autoattack"] = res.robust_accuracy["autoattack"]
    model64 = _float64_copy(model)
    x64 = x.to(torch.float64)
    log("block Jacobians")
    t0 = time.perf_counter()
    jac = jacobian_spectrum(model64, x64[: settings.n_jacobian])
    seconds["jacobian"] = time.perf_counter() - t0
    out: dict[str, Any] = {
        "clean": clean,
        "robust": robust,
        "jacobian_mean": jac.sigma.mean(axis=1).tolist(),
        "jacobian_std": jac.sigma.std(axis=1).tolist(),
        "jacobian_method": jac.method,
    }
    t0 = time.perf_counter()
    try:
        report = certify_samples(model64, x64, y, ["lofast"], settings.eps_l2)
    except UnsupportedModelError as err:  # recorded in the report, not hidden
        out["certified"], out["certified_note"] = None, str(err)
    else:
        out["certified"] = {
            f"l2 {r.eps:g}": r.certified_accuracy for r in report.results
        }
    seconds["certify"] = time.perf_counter() - t0
    out["seconds"] = seconds
    return out


def _float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    from lipvit.model import ViT

    copy = ViT(model.config).to(torch.float64)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


# ------------------------------------------------------------------ driver


def run_compare(
    out: str | Path,
    settings: CompareSettings,
    data,
    test_index: np.ndarray,
    *,
    force: bool = False,
    progress: bool = False,
    log: Log | None = None,
) -> Comparison:
    """Train or reuse every model of :func:`runs` and evaluate it.

    Args:
        out: output directory (``out/models`` holds checkpoints and caches).
        settings: what to train and measure.
        data: the :class:`lipvit.data.Dataset` named by ``settings.dataset``.
        test_index: the test images to attack and certify (indices).
        force: retrain and re-evaluate everything.
        progress: training progress bars.
        log: receives one line per stage.

    Raises:
        LipvitError: ``out`` holds another comparison (see :func:`check_settings`),
            or a checkpoint cannot be resumed with these settings.
    """
    from lipvit.checkpoint import load_checkpoint
    from lipvit.train import cpu_threads

    emit = log or (lambda line: None)
    out = Path(out)
    check_settings(out, settings, force)
    models = out / "models"
    idx = torch.as_tensor(test_index, device=data.x_test.device)
    x, y = data.x_test[idx], data.y_test[idx]
    plan, notes = runs(settings)
    rows, jacobian, details = [], {}, {}
    t_train = t_eval = 0.0
    for run in plan:
        t0 = time.perf_counter()
        summary = train_run(run, settings, data, models, force=force,
                            progress=progress, log=emit)
        t_train += time.perf_counter() - t0
        ckpt = models / f"{run.name}.pt"
        cache = models / f"{run.name}.eval.json"
        t0 = time.perf_counter()
        ev = _cached_evaluation(cache, ckpt, settings, force, run.name, emit)
        if ev is None:
            model = load_checkpoint(ckpt).model
            with cpu_threads(model.config, torch.device("cpu")):
                ev = evaluate_run(model, x, y, settings,
                                  lambda s, n=run.name: emit(f"{n}: {s}"))
            ev["settings"] = settings.evaluation()
            write_json(cache, ev, force=True)
        t_eval += time.perf_counter() - t0
        details[run.name] = {"summary": _short(summary), "evaluation": ev}
        jacobian[run.name] = ev["jacobian_mean"]
        rows.append(_row(run, summary, ev))
    _add_ratios(rows)
    for r in rows:
        if r.get("certified_note"):
            notes.append(f"{r['model']}: no certificate ({r['certified_note']})")
    return Comparison(
        settings, rows, jacobian, _dedupe(notes),
        {"train_wall": t_train, "evaluate_wall": t_eval},
        {"models": details, "n_test": int(x.shape[0]),
         "dataset": data.describe()},
    )


def _cached_evaluation(
    cache: Path, ckpt: Path, settings: CompareSettings, force: bool, name: str,
    emit: Log,
) -> dict[str, Any] | None:
    """The cached evaluation if it was made of this checkpoint with these
    settings, else ``None`` (and a log line saying why it is redone)."""
    if force or not cache.exists():
        return None
    if cache.stat().st_mtime < ckpt.stat().st_mtime:
        emit(f"{name}: checkpoint newer than its evaluation: evaluating again")
        return None
    ev = json.loads(cache.read_text())
    saved, mine = ev.get("settings", {}), settings.evaluation()
    diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
    if diff:
        emit(f"{name}: evaluation settings changed ({', '.join(diff)}): "
             "evaluating again")
        return None
    emit(f"{name}: evaluation reused ({cache})")
    return ev


def _short(summary: dict[str, Any]) -> dict[str, Any]:
    keep = ("test_acc", "epochs", "seconds", "params", "checkpoint")
    return {k: summary.get(k) for k in keep}


def _dedupe(notes: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(notes))


def _row(run: Run, summary: dict[str, Any], ev: dict[str, Any]) -> dict[str, Any]:
    """One table row: accuracies, timings, σ statistics, certificates."""
    hist = summary.get("history") or []
    sig = summary["sigma_max"]
    row: dict[str, Any] = {
        "model": run.name,
        "attention": run.attention,
        "msvp": run.msvp,
        "clean": ev["clean"],
        **{k: v for k, v in ev["robust"].items()},
        # Medians: robust to the first epoch's one-time costs and to other
        # jobs on a shared machine.
        "wall_per_epoch": _median(hist, "seconds"),
        "cpu_per_epoch": _median(hist, "cpu_seconds"),
        "sigma_q": sig["mean_q"],
        "sigma_k": sig["mean_k"],
        "sigma_v": sig["mean_v"],
        "jacobian_sum": float(np.sum(ev["jacobian_mean"])),
    }
    if ev["certified"] is not None:
        row.update({f"certified {k}": v for k, v in ev["certified"].items()})
    else:
        row["certified_note"] = ev["certified_note"]
    return row


def _median(history: list[dict[str, Any]], key: str) -> float | None:
    values = [h[key] for h in history if h.get(key)]
    return float(np.median(values)) if values else None


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Epoch-time ratios to vanilla (``dot`` without MSVP), wall and CPU."""
    ref = next(r for r in rows if r["model"] == "dot")
    for r in rows:
        for key in ("wall_per_epoch", "cpu_per_epoch"):
            base, value = ref.get(key), r.get(key)
            r[key.replace("per_epoch", "ratio")] = (
                value / base if value is not None and base else None
            )


# ------------------------------------------------------------------ outputs


def table_columns(settings: CompareSettings) -> list[tuple[str, str]]:
    """``(row key, header)`` of the digits table in SpecFormer's shape."""
    cols = [("model", "model"), ("clean", "clean")]
    aa = f"AA(n={settings.n_autoattack})"
    for norm, radii, attacks in (
        ("linf", settings.eps_linf, ["fgsm", "pgd"]),
        ("l2", settings.eps_l2, ["pgd-l2"]),
    ):
        if settings.autoattack:
            attacks = [*attacks, "autoattack"]
        for e in radii:
            shown = f"{e * 255:.3g}/255" if norm == "linf" else f"{e:g}"
            sym = "ℓ∞" if norm == "linf" else "ℓ2"
            for a in attacks:
                label = {"pgd-l2": "PGD", "pgd": "PGD", "fgsm": "FGSM",
                         "autoattack": aa}[a]
                cols.append((f"{norm} {e:g} {a}", f"{label} {sym} {shown}"))
    for e in settings.eps_l2:
        cols.append((f"certified l2 {e:g}", f"cert. ℓ2 {e:g}"))
    cols += [
        ("cpu_per_epoch", "CPU s/epoch"),
        ("cpu_ratio", "CPU ×vanilla"),
        ("wall_per_epoch", "wall s/epoch"),
        ("wall_ratio", "wall ×vanilla"),
        ("sigma_q", "σ̄ W_q"),
        ("sigma_k", "σ̄ W_k"),
        ("sigma_v", "σ̄ W_v"),
        ("jacobian_sum", "Σ_k σ(J_k)"),
    ]
    return cols


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool | str):
        return str(value)
    if key == "clean" or key.startswith(("linf ", "l2 ", "certified ")):
        return f"{100 * value:.1f}"
    if key.endswith("ratio"):
        return f"{value:.2f}×"
    return f"{value:.3g}"


def markdown_table(comp: Comparison) -> str:
    """The digits table (accuracies in %) as markdown."""
    cols = table_columns(comp.settings)
    lines = [
        "| " + " | ".join(h for _, h in cols) + " |",
        "|" + "|".join("---" for _ in cols) + "|",
    ]
    for r in comp.rows:
        lines.append("| " + " | ".join(_fmt(k, r.get(k)) for k, _ in cols) + " |")
    return "\n".join(lines)


def jacobian_figure(jacobian: dict[str, list[float]], method: str, path=None):
    """Per-block σ_max of the residual-branch Jacobian, one line per model.

    Solid lines: exact values (dense SVD) or, when ``method`` says so,
    power-iteration estimates from below (then stated in the title). Colour:
    attention; open markers: MSVP. Log axis when the values span decades.
    """
    from lipvit.analysis.plots import new_figure, save_figure, spans_decades

    fig, axes = new_figure(6.4, 4.2)
    ax = axes[0, 0]
    attentions = list(dict.fromkeys(n.removesuffix("-msvp") for n in jacobian))
    colors = {a: f"C{i}" for i, a in enumerate(attentions)}
    for name, values in jacobian.items():
        a = name.removesuffix("-msvp")
        msvp = name.endswith("-msvp")
        blocks = np.arange(1, len(values) + 1)
        ax.plot(blocks, values, "-", color=colors[a], marker="s" if msvp else "o",
                markerfacecolor="white" if msvp else colors[a],
                linewidth=1.2 if msvp else 2.0, label=name)
    all_values = np.concatenate([np.asarray(v, float) for v in jacobian.values()])
    if spans_decades(all_values):
        ax.set_yscale("log")
    n_blocks = max(len(v) for v in jacobian.values())
    ax.set_xticks(np.arange(1, n_blocks + 1))
    ax.set_xlabel("block k")
    ax.set_ylabel(r"$\sigma_{\max}(J_{F_k})$ at clean points (mean over samples)")
    what = "exact" if method.startswith("exact") else "power-iteration estimate"
    ax.set_title(f"per-block Jacobian spectral norm ({what})", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    if path is not None:
        save_figure(fig, path)
    return fig


def accuracy_figure(comp: Comparison, path=None):
    """Grouped bars: clean and robust accuracy at the largest radii, per model."""
    from lipvit.analysis.plots import new_figure, save_figure

    s = comp.settings
    e_inf, e_2 = max(s.eps_linf), max(s.eps_l2)
    inf = f"ℓ∞ {e_inf * 255:.3g}/255"
    keys = [("clean", "clean"), (f"linf {e_inf:g} fgsm", f"FGSM {inf}"),
            (f"linf {e_inf:g} pgd", f"PGD {inf}")]
    if s.autoattack:
        keys.append((f"linf {e_inf:g} autoattack",
                     f"AutoAttack {inf} (n={s.n_autoattack})"))
    keys.append((f"l2 {e_2:g} pgd-l2", f"PGD ℓ2 {e_2:g}"))
    if s.autoattack:
        keys.append((f"l2 {e_2:g} autoattack",
                     f"AutoAttack ℓ2 {e_2:g} (n={s.n_autoattack})"))
    fig, axes = new_figure(8.0, 4.2)
    ax = axes[0, 0]
    n = len(comp.rows)
    width = 0.8 / len(keys)
    for j, (key, label) in enumerate(keys):
        values = [100 * (r.get(key) or 0.0) for r in comp.rows]
        ax.bar(np.arange(n) + (j - (len(keys) - 1) / 2) * width, values, width,
               label=label, color=f"C{j}")
    ax.set_xticks(np.arange(n))
    ax.set_xticklabels([r["model"] for r in comp.rows], rotation=30, ha="right",
                       fontsize=8)
    ax.set_ylabel("accuracy (%), robust = upper bound (attacks)")
    ax.set_ylim(0, 118)
    ax.set_yticks(np.arange(0, 101, 20))
    ax.set_title(f"{s.dataset}, {s.preset}, {s.epochs} epochs, "
                 f"n = {comp.data.get('n_test')}", fontsize=10)
    ax.legend(fontsize=7, ncol=len(keys), loc="upper center")
    if path is not None:
        save_figure(fig, path)
    return fig


def write_report(comp: Comparison, out: str | Path, command: str) -> list[Path]:
    """Write ``compare.csv``, ``compare.json``, ``jacobian.png``, ``accuracy.png``
    and ``report.md`` under ``out`` (regenerated from the cached results)."""
    import csv

    out = Path(out)
    paths = [out / f for f in FILES]
    cols = table_columns(comp.settings)
    with open(paths[0], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([k for k, _ in cols])
        for r in comp.rows:
            w.writerow(["" if r.get(k) is None else r.get(k) for k, _ in cols])
    write_json(paths[1], {
        "command": command, "settings": comp.settings.to_dict(), "rows": comp.rows,
        "jacobian": comp.jacobian, "notes": comp.notes, "seconds": comp.seconds,
        **comp.data,
    }, force=True)
    methods = {m["evaluation"]["jacobian_method"]
               for m in comp.data["models"].values()}
    jacobian_figure(comp.jacobian, sorted(methods)[0], paths[2])
    accuracy_figure(comp, paths[3])
    paths[4].write_text(_markdown(comp, command, sorted(methods)))
    return paths


def _markdown(comp: Comparison, command: str, methods: list[str]) -> str:
    s = comp.settings
    sec = comp.seconds
    lines = [
        f"# Attention comparison: {s.dataset}, preset {s.preset}",
        "",
        f"Command: `{command}`",
        "",
        f"{s.epochs} epochs per model, MSVP λ_q = λ_k = λ_v = {s.msvp:g}, seed "
        f"{s.seed}; attacks on n = {comp.data.get('n_test')} test images "
        f"(PGD {s.attack_steps} steps, step 2.5ε/steps, random start"
        + (f", AutoAttack standard with its original counts on the first "
           f"{s.n_autoattack} of them" if s.autoattack
           else "; AutoAttack not run: pass --autoattack")
        + "). Accuracies in %; robust accuracies are upper bounds (attacks find "
        "adversarial points, they prove nothing); certified accuracy is the LoFAST "
        "network certificate (sound), for dot-product attention only.",
        "",
        markdown_table(comp),
        "",
        "Epoch time: median over epochs of the process CPU time and of the wall "
        "time of one training epoch (both include the per-epoch test evaluation "
        "and exact σ statistics); ratios are to `dot` without MSVP, measured in "
        "the same run.",
        "",
        "![per-block Jacobian](jacobian.png)",
        "",
        f"Per-block σ_max of the residual-branch Jacobian J_{{F_k}} at "
        f"{s.n_jacobian} clean test points ({'; '.join(methods)}).",
        "",
        "![accuracy](accuracy.png)",
        "",
        "## Notes",
        "",
        *[f"- {n}" for n in comp.notes],
        "",
        f"Training {sec.get('train_wall', 0):.0f} s and evaluation "
        f"{sec.get('evaluate_wall', 0):.0f} s of wall time in the invocation that "
        "wrote this report (reused models and evaluations cost ~0).",
        "",
    ]
    return "\n".join(lines)

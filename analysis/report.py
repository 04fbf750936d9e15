"""``report.md`` of a pipeline run: markdown tables and figures from results files.

Everything here is a pure function of the JSON written by the commands
(``lipvit train``'s summary, ``attack --json``, ``certify --json``,
``tightness``, ``spectrum``) returning markdown text; :class:`Report` collects
sections and writes the file. Figures are embedded by links relative to the
report's directory, so the run directory can be moved or published as is.
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METHOD_SENTENCES = {
    "lofast": "bounds how far the whole logit vector moves, δ_out, layer by layer "
              "(LoFAST); certified when the margin exceeds √2·δ_out (LoFAST "
              "Prop. 1).",
    "lofast-fast": "the same bound with power-iteration estimates: **not** a "
                   "certificate.",
    "specformer": "the same with SpecFormer's Theorem 4.2 per attention layer.",
    "taylor": "bounds each wrong-class margin's drop separately: its exact "
              "first-order term plus proven remainders (docs/taylor.md).",
    "crown": "bounds each wrong-class margin by CROWN's linear relaxations "
             "(auto_LiRPA).",
    "alpha-crown": "CROWN with optimised ReLU slopes.",
    "global": "bounds each class pair's margin by the model's proven global "
              "Lipschitz constant, ε·L·‖w_y − w_j‖ (the hybrid ViT, CaiT; "
              "docs/math.md §9).",
    "ball": "bounds each class pair's margin by ε·L(x, ε)·‖w_y − w_j‖, the "
            "attention maps' local constants over the ε-ball times the other "
            "maps' proven ones (the hybrid ViT, CaiT; docs/math.md §10).",
    "margin": "bounds each wrong-class margin's drop by its exact first-order "
              "term through attention plus proven remainders, cut anywhere in the "
              "chain; never weaker than ball (docs/math.md §11).",
    "smoothing": "randomized smoothing (Cohen et al. 2019): a **probabilistic** "
                 "certificate (probability 1 − α per point) of the smoothed "
                 "classifier under Gaussian noise, **not** of the network.",
}
"""One sentence per method: what it bounds (the certified-accuracy section)."""

METHOD_BOUNDS = {
    "lofast": "the logit vector (√2·δ_out)",
    "lofast-fast": "the logit vector, estimated (not a certificate)",
    "specformer": "the logit vector (SpecFormer, √2·δ_out)",
    "taylor": "each wrong-class margin",
    "crown": "each wrong-class margin (CROWN)",
    "alpha-crown": "each wrong-class margin (α-CROWN)",
    "cascade": "LoFAST, then CROWN where it did not certify",
    "cascade-taylor": "taylor, then CROWN where it did not certify",
    "global": "each class pair (the proven global constant)",
    "ball": "each class pair (local constants over the ε-ball)",
    "margin": "each wrong-class margin (first order through attention)",
    "smoothing": "the smoothed classifier, with probability 1 − α (probabilistic)",
}
"""What each method bounds, in a few words: the figure captions."""


def method_caption(methods: Iterable[str]) -> str:
    """``what each method bounds — `m`: …; …`` for the methods of a figure."""
    parts = [f"`{m}`: {METHOD_BOUNDS[m]}" for m in methods if m in METHOD_BOUNDS]
    return "what each method bounds — " + "; ".join(parts) + "." if parts else ""



def proven_sentence(proven: Mapping[str, Any]) -> str:
    """What the lipschitz model's summary says of a hybrid ViT or CaiT: its
    proven global constant, each attention block's logit spread and (newer
    summaries) its accuracy without attention."""
    name = {"cait": "CaiT"}.get(proven.get("arch", "hybrid"), "the hybrid ViT")
    blocks = "; ".join(
        f"block {i}: logit spread {a['total']:.2f} (content {a['content']:.2f}, "
        f"positional {a['positional']:.2f}), gate g = {a['gate']:.3f}, "
        f"L_A = {a['lipschitz']:.2f}" for i, a in enumerate(proven["attention"]))
    ablation = ("" if "ablated_accuracy" not in proven else
                f" Accuracy on those images {proven['accuracy']:.3f}, with every "
                f"attention term removed {proven['ablated_accuracy']:.3f}.")
    return (f"The lipschitz model is {name} (docs/math.md §9): proven global "
            f"constant L = {proven['global_constant']:.4f}; mean attention logit "
            f"spread per query on 1000 test images, {blocks}.{ablation} It is "
            "certified by `ball` and `global`; the LoFAST tightness and CROWN "
            "steps do not apply.")

def fmt(value: Any, digits: int = 4) -> str:
    """A table cell: floats with ``digits`` significant digits, ``None`` as ``–``."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}"
    return str(value)


def pct(value: float | None) -> str:
    """``0.934`` → ``93.4 %``."""
    return "–" if value is None else f"{100 * value:.1f} %"


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table (cells through :func:`fmt` unless strings)."""

    def cell(v: Any) -> str:
        return (v if isinstance(v, str) else fmt(v)).replace("|", "\\|")

    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line(args: Sequence[str], prog: str = "lipvit") -> str:
    """``prog`` and ``args`` as one shell-quoted line."""
    return " ".join([prog, *(shlex.quote(str(a)) for a in args)])


@dataclass
class Report:
    """A markdown document built section by section.

    Attributes:
        title: the top heading.
        root: directory of the report file; image links are made relative to it.
    """

    title: str
    root: Path
    parts: list[str] = field(default_factory=list)

    def heading(self, text: str, level: int = 2) -> None:
        self.parts.append("#" * level + " " + text)

    def text(self, text: str) -> None:
        self.parts.append(text.strip())

    def table(self, headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        self.parts.append(md_table(headers, rows))

    def image(self, path: str | os.PathLike, alt: str) -> None:
        """Embed an image by a link relative to :attr:`root` (POSIX separators)."""
        rel = Path(os.path.relpath(Path(path), self.root)).as_posix()
        self.parts.append(f"![{alt}]({rel})")

    def code(self, lines: str | Sequence[str], lang: str = "bash") -> None:
        body = lines if isinstance(lines, str) else "\n".join(lines)
        self.parts.append(f"```{lang}\n{body}\n```")

    def render(self) -> str:
        return "\n\n".join([f"# {self.title}", *self.parts]) + "\n"


# ------------------------------------------------------------------ sections


def training_rows(summaries: Mapping[str, Mapping[str, Any]]) -> list[list[Any]]:
    """Rows ``model, family, MSVP λ, epochs, test acc, mean σ_max(W_q,W_k,W_v), s``."""
    rows = []
    for name, s in summaries.items():
        tc = s.get("train_config") or {}
        lam = tc.get("msvp") or [0, 0, 0]
        sig = s.get("sigma_max") or {}
        rows.append(
            [
                name,
                s.get("family"),
                fmt(max(lam)) if any(lam) else "0",
                s.get("epochs"),
                pct(s.get("test_acc")),
                sig.get("mean"),
                sig.get("max"),
                s.get("seconds"),
            ]
        )
    return rows


TRAINING_HEADERS = [
    "model",
    "family",
    "MSVP λ",
    "epochs",
    "test accuracy",
    "mean σ_max(W_q,W_k,W_v)",
    "max σ_max",
    "train s",
]


def _wide(
    rows: Sequence[Mapping[str, Any]], key: str, value: str
) -> tuple[list[float], dict[str, dict[float, Any]]]:
    """Pivot result rows to ``key`` → ε → ``value`` (keys in order of appearance)."""
    eps = sorted({float(r["eps"]) for r in rows})
    table: dict[str, dict[float, Any]] = {}
    for r in rows:
        table.setdefault(r[key], {})[float(r["eps"])] = r[value]
    return eps, table


def attack_table(
    runs: Mapping[str, Mapping[str, Any]],
) -> tuple[list[str], list[list[Any]]]:
    """Robust accuracy, one row per (model, attack) and one column per ε.

    Args:
        runs: model name → ``lipvit attack --json`` output (same ε for all).
    """
    all_eps = sorted({float(r["eps"]) for d in runs.values() for r in d["results"]})
    norm = next(iter(runs.values())).get("norm", "")
    headers = ["model", "attack", *(f"ε = {fmt(e)} ({norm})" for e in all_eps)]
    rows = []
    for name, data in runs.items():
        _, table = _wide(data["results"], "attack", "robust_accuracy")
        for attack, by_eps in table.items():
            rows.append([name, attack, *(pct(by_eps.get(e)) for e in all_eps)])
    return headers, rows


def certify_table(
    runs: Mapping[str, Mapping[str, Any]],
) -> tuple[list[str], list[list[Any]]]:
    """Certified accuracy, one row per (model, method), one column per ε, then the
    mean seconds per sample and whether the method certifies (``exact``)."""
    all_eps = sorted({float(r["eps"]) for d in runs.values() for r in d["results"]})
    headers = [
        "model",
        "method",
        *(f"ε = {fmt(e)}" for e in all_eps),
        "s/sample",
        "exact",
    ]
    rows = []
    for name, data in runs.items():
        _, table = _wide(data["results"], "method", "certified_accuracy")
        for method, by_eps in table.items():
            mine = [r for r in data["results"] if r["method"] == method]
            seconds = sum(r["seconds_per_sample"] for r in mine) / len(mine)
            exact = all(r.get("exact", True) for r in mine)
            probabilistic = any(r.get("guarantee") == "probabilistic" for r in mine)
            rows.append(
                [
                    name,
                    method,
                    *(pct(by_eps.get(e)) for e in all_eps),
                    seconds,
                    "no (probabilistic)" if probabilistic
                    else "yes" if exact else "no (estimate)",
                ]
            )
    return headers, rows


def radius_rows(name: str, data: Mapping[str, Any]) -> list[list[Any]]:
    """Median certified radius per method (correct samples only count as certified)."""
    samples = data.get("samples") or []
    methods = list(dict.fromkeys(m for s in samples for m in (s.get("radii") or {})))
    rows = []
    for m in methods:
        radii = sorted(float(s["radii"][m]) for s in samples)
        mid = len(radii) // 2
        median = radii[mid] if len(radii) % 2 else (radii[mid - 1] + radii[mid]) / 2
        rows.append([name, m, median, max(radii)])
    return rows


def gap_table(certify: Any, attack: Any) -> tuple[list[str], list[list[Any]]]:
    """Per certification method: medians of the certified radius, the attack radius,
    their ratio and the first-order limit, over the correctly classified samples
    and over the certified ones (:func:`lipvit.analysis.gap.summary_rows`)."""
    from lipvit.analysis.gap import join, summary_rows

    headers = ["method", "points", "n", "median certified radius",
               "median attack radius", "median certified/attack",
               "median first-order limit"]
    rows = [[r.label, r.points, r.n,
             r.median_certified, r.median_attack, r.median_ratio,
             r.median_first_order] for r in summary_rows(join(certify, attack))]
    return headers, rows


def tightness_rows(
    data: Mapping[str, Any], eps: Sequence[float] | None = None, centre: str = "mean"
) -> tuple[list[str], list[list[Any]]]:
    """Wide table: one row per ε, per method ``mean bound (ratio ×)``, and mean PGD;
    ``centre="median"``: medians, with the median of the per-sample ratios."""
    ratio = "ratio" if centre == "mean" else "ratio_median"
    rows = data["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    all_eps = sorted({r["eps"] for r in rows})
    chosen = all_eps if eps is None else [e for e in all_eps if e in set(eps)]
    by = {(r["method"], r["eps"]): r for r in rows}
    headers = ["ε", "PGD (lower bound)", *methods]
    table = []
    for e in chosen:
        first = by[(methods[0], e)]
        cells = [fmt(e), fmt(first[f"pgd_{centre}"])]
        for m in methods:
            r = by[(m, e)]
            cells.append(f"{fmt(r[f'bound_{centre}'])} ({r[ratio]:.4g}×)")
        table.append(cells)
    return headers, table


def spectrum_rows(data: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Per block and penalised matrix: largest-head σ_max of every checkpoint."""
    comparison = data.get("comparison") or {}
    rows = comparison.get("rows") or []
    labels = list(data["weights"])
    headers = [
        "block",
        "matrix",
        *(f"σ_max {lb}" for lb in labels),
        *(f"{lb} lower?" for lb in labels[1:]),
    ]
    table = [
        [
            r["layer"],
            r["matrix"],
            *(r[lb] for lb in labels),
            *("yes" if r[f"lower: {lb}"] else "no" for lb in labels[1:]),
        ]
        for r in rows
    ]
    return headers, table


def jacobian_rows(data: Mapping[str, Any]) -> list[list[Any]]:
    """Per checkpoint and block: mean (std) σ_max(J_F) and mean sqrt(‖J‖₁‖J‖∞)."""
    rows = []
    for label, j in data["jacobian"].items():
        for k, (m, s, e) in enumerate(
            zip(j["sigma_mean"], j["sigma_std"], j["l1_linf_mean"], strict=True)
        ):
            rows.append(
                [
                    label,
                    k,
                    f"{fmt(m)} ({fmt(s, 2)})",
                    e,
                    "exact" if j["exact"] else "lower estimate",
                ]
            )
    return rows


def deviation_rows(data: Mapping[str, Any]) -> list[list[Any]]:
    """Per checkpoint and ε: first-order estimate, certified bound, PGD."""
    return [
        [
            r["checkpoint"],
            r["eps"],
            r["first_order_mean"],
            r.get("product_mean"),
            r["certified_mean"],
            r["pgd_mean"],
        ]
        for r in data.get("deviation_summary") or []
    ]


# ------------------------------------------------------------ the pipeline's report


def _read(path: Path) -> Any:
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _budget(trace: Mapping[str, Any], j: int, i: int) -> str:
    """Cell ``all / cls`` of a network trace at ε index ``j`` and step ``i``."""
    cell = fmt(trace["mean"][j][i])
    if "mean_cls" in trace:
        cell += f" / {fmt(trace['mean_cls'][j][i])}"
    return cell


def _commands(report: Report, commands: Mapping[str, str], keys: Sequence[str]) -> None:
    lines = [commands[k] for k in keys if k in commands]
    if lines:
        report.text("Reproduce:")
        report.code(lines)


def _tightness_results(out: Path, keys: Sequence[str]) -> list[tuple[str, Any]]:
    """``(key, tightness.json)`` of the runs under ``out/tightness/`` that exist."""
    found = [(key, _read(out / "tightness" / key / "tightness.json")) for key in keys]
    return [(key, data) for key, data in found if data]


def _tightness_part(rep: Report, data: Mapping[str, Any], pgd: str,
                    centre: str) -> None:
    """A tightness result's description, notes, table and soundness warning."""
    rep.text(f"{data['description']}; {pgd} {data['pgd']['steps']} steps × "
             f"{data['pgd']['restarts']} restarts.")
    for note in data.get("notes") or []:
        rep.text(f"Note: {note}.")
    rep.table(*tightness_rows(data, centre=centre))
    bad = {m: v for m, v in (data.get("violations") or {}).items() if v}
    if bad:
        rep.text(f"**Warning**: bounds below PGD (unsound or estimates): {bad}.")


def pipeline_report(
    out: Path,
    commands: Mapping[str, str],
    record: Mapping[str, Any],
) -> Report:
    """The :class:`Report` of a ``lipvit pipeline`` run in directory ``out``.

    Args:
        out: the run directory (``models/``, ``attack/``, ``certify/``,
            ``tightness/``, ``spectrum/``); the report goes to ``out/report.md``.
        commands: step key (``"train/vanilla"``, ``"attack/msvp"``, ...) → the
            ``lipvit`` command line of that step.
        record: ``pipeline.json`` (settings, timings).

    Sections whose results are missing are left out.
    """
    out = Path(out)
    rep = Report("lipvit pipeline report", out)
    settings = record.get("settings", {})
    rep.text(
        f"Dataset **{record.get('dataset', '?')}**, "
        f"device `{record.get('device', '?')}`"
        + (
            " (**fast mode**: smoke-test sizes, numbers not meaningful)"
            if record.get("fast")
            else ""
        )
        + ". Three models: a vanilla standard ViT (no penalty), the same with the MSVP "
        f"penalty (λ = {settings.get('msvp', '?')}, SpecFormer eq. 11) and a "
        "lipschitz-family ViT (LoFAST §5.2). All perturbations are ℓ2 on images with "
        "pixels in [0, 1]. Every command below is exactly what the pipeline ran "
        "(it adds `--resume`/`--force` only); `lipvit pipeline --out "
        f"{out.as_posix()}` reruns the steps whose outputs are missing."
    )

    # Training.
    summaries = {
        name: _read(out / "models" / f"{name}.json")
        for name in ("vanilla", "msvp", "lipschitz")
    }
    summaries = {k: v for k, v in summaries.items() if v}
    if summaries:
        rep.heading("Training")
        rep.table(TRAINING_HEADERS, training_rows(summaries))
        lip = summaries.get("lipschitz", {})
        proven = lip.get("proven", lip.get("hybrid"))
        rep.text(
            "σ_max: exact largest singular values (dense SVD) of every head's "
            "W_q, W_k, W_v."
            + ("" if not proven else " " + proven_sentence(proven))
        )
        _commands(rep, commands, [f"train/{n}" for n in summaries])

    # Attacks.
    attacks = {
        n: _read(out / "attack" / f"{n}.json") for n in ("vanilla", "msvp", "lipschitz")
    }
    attacks = {k: v for k, v in attacks.items() if v}
    if attacks:
        rep.heading("Robust accuracy under attack")
        first = next(iter(attacks.values()))
        rep.text(
            f"n = {first.get('n')} test images; clean accuracy "
            + ", ".join(
                f"{k} {pct(v.get('clean_accuracy'))}" for k, v in attacks.items()
            )
            + ". Attacks only find adversarial points, so these are upper bounds "
            "of the true robust accuracy (the empirical ceiling of the certified "
            "accuracy below)."
        )
        rep.table(*attack_table(attacks))
        _commands(rep, commands, [f"attack/{n}" for n in attacks])

    # Certification.
    certs = {n: _read(out / "certify" / f"{n}.json") for n in ("lipschitz", "msvp")}
    certs = {k: v for k, v in certs.items() if v}
    crown = _read(out / "certify" / "lipschitz-crown.json")
    if certs or crown:
        rep.heading("Certified accuracy")
        used = sorted({r.get("method") for d in certs.values()
                       for r in d.get("results", [])} & set(METHOD_SENTENCES))
        rep.text(
            "A point is certified at ε when it is classified correctly and no "
            "point of the ℓ2 ball of radius ε around it can change its label; "
            "each sound method proves it from a different bound. "
            + " ".join(f"`{m}`: {METHOD_SENTENCES[m]}" for m in used)
            + " The MSVP model is a standard (LayerNorm) ViT: its bounds go "
            "through the local LayerNorm constants (docs/math.md §6)."
        )
        if certs:
            rep.text("Test points certified: " + ", ".join(
                f"{name} n = {d.get('n')} (clean accuracy "
                f"{pct(d.get('clean_accuracy'))})" for name, d in certs.items()) + ".")
            rep.table(*certify_table(certs))
        rrows = [row for name, data in certs.items() for row in radius_rows(name, data)]
        if rrows:
            rep.text(
                "Certified radius per sample (the largest ε proven by the search; "
                "0 for misclassified samples):"
            )
            rep.table(["model", "method", "median radius", "max radius"], rrows)
        for name, data in certs.items():
            fig = out / "certify" / f"{name}.png"
            if fig.exists():
                rep.image(fig, f"certified accuracy of {name}")
                methods = dict.fromkeys(r.get("method") for r in data["results"])
                rep.text(f"Figure: certified and attacked accuracy of the {name} "
                         f"model per ε; {method_caption(methods)}")
        if crown:
            rep.text(
                f"CROWN (auto_LiRPA) and the LoFAST→CROWN cascade on the lipschitz "
                f"model, n = {crown.get('n')} (CROWN is slow on a CPU):"
            )
            rep.table(*certify_table({"lipschitz": crown}))
        elif record.get("crown_available") is False:
            rep.text(
                "CROWN: auto_LiRPA is not installed, so the CROWN rows are missing "
                "(see the README for installing it)."
            )
        else:
            rep.text(
                "CROWN and the LoFAST→CROWN cascade were not run (on a CPU CROWN takes "
                "minutes per sample for this model: about 100 s per sample measured "
                "for the digits-small lipschitz model on 2 cores); `lipvit pipeline "
                "--crown` adds "
                "them, or run `lipvit certify --method lofast,crown,cascade` on a few "
                "samples."
            )
        _commands(
            rep,
            commands,
            [
                *(f"certify/{n}" for n in certs),
                *(f"plot/{n}" for n in certs),
                "certify/lipschitz-crown",
            ],
        )

    # Certification gap.
    radius = _read(out / "attack" / "radius.json")
    if radius and certs.get("lipschitz"):
        rep.heading("Certification gap (lipschitz model)")
        settings = radius.get("settings") or {}
        rep.text(
            "Per sample: the certified radius of each method (a lower bound of the "
            "true robust radius; `(estimate)` rows are not bounds) against the "
            "smallest adversarial radius the attacks found (worst case over "
            f"{', '.join(radius.get('attacks') or [])}, {settings.get('steps')} "
            "steps, bisection on ε; the verified distance of a misclassified point: "
            "an upper bound). The true radius lies between the two, so a sound "
            "method's points lie on or below y = x. The first-order limit "
            "min_j margin_j/‖∇_x margin_j‖ is the distance to the linearised "
            "decision boundary: an estimate, not a bound. Medians over the "
            "correctly classified samples (uncertified ones count with radius 0), "
            "then over the certified samples alone."
        )
        rep.table(*gap_table(certs["lipschitz"], radius))
        if (out / "certify" / "gap.png").exists():
            rep.image(out / "certify" / "gap.png", "certification gap")
            methods = dict.fromkeys(r.get("method")
                                    for r in certs["lipschitz"]["results"])
            rep.text("Figure: each sample's certified radius against its attack "
                     f"radius; {method_caption(methods)}")
        _commands(rep, commands, ["attack/radius", "plot/gap"])

    # Tightness.
    parts = _tightness_results(out, ("layer", "layer-residual", "layer-vanilla",
                                     "network"))
    if parts:
        rep.heading("Tightness of the bounds")
        rep.text(
            "Mean upper bound over the samples with its ratio to the PGD lower "
            "bound (bound/PGD ≥ 1 for a sound bound; the true maximal deviation "
            "lies between PGD and the bound). LoFAST Fig. 1 and Table 3 "
            "analogues; every ratio at every ε is in the CSV next to each figure."
        )
        titles = {
            "layer": "Lipschitz model: one attention layer, H as in the model",
            "layer-residual": "Lipschitz model: one attention layer with H = I "
            "(LoFAST Table 3 setting)",
            "layer-vanilla": "Vanilla model (--msvp 0): one attention layer, "
            "attention not made uniform by MSVP",
            "network": "Lipschitz model: whole network, image to logits",
        }
        for key, data in parts:
            rep.heading(titles[key], 3)
            _tightness_part(rep, data, f"n = {data['n']}, PGD", "mean")
            trace = (data.get("traces") or {}).get("lofast")
            if trace:
                rep.text(
                    "Where the composed `lofast` bound grows: mean budget after each "
                    "step for the whole token matrix"
                    + (" / the class token" if "mean_cls" in trace else "")
                    + " (the head reads the class token)."
                )
                n_eps = len(data["eps"])
                rep.table(
                    ["step", *(f"ε = {fmt(e)}" for e in data["eps"])],
                    [
                        [name, *(_budget(trace, j, i) for j in range(n_eps))]
                        for i, name in enumerate(trace["steps"])
                    ],
                )
            fig = out / "tightness" / key / "tightness.png"
            if fig.exists():
                rep.image(fig, f"tightness ({key})")
        _commands(rep, commands, [f"tightness/{k}" for k, _ in parts])

    # The certificate that decides.
    margins = _tightness_results(out, ("margin-lipschitz", "margin-msvp"))
    if margins:
        rep.heading("Tightness of the certificate that decides")
        rep.text(
            "A point is certified when every wrong class's margin m_j = f_y − f_j "
            "exceeds its method's bound on how far m_j can drop over the ball. Per "
            "ε: each method's bound on that drop against the largest drop a "
            "targeted PGD attack on the same margin finds (a lower bound), over "
            "every (image, wrong class) pair at the model's prediction: medians, "
            "and the median of the per-pair ratios bound/PGD (≥ 1 for a sound "
            "bound). `taylor` bounds each margin on its own; `lofast` and "
            "`specformer` bound the whole logit vector, √2·δ_out for every margin."
        )
        for key, data in margins:
            name = key.removeprefix("margin-")
            rep.heading(f"{name} model", 3)
            _tightness_part(rep, data, "targeted PGD per pair,", "median")
            fig = out / "tightness" / key / "tightness.png"
            if fig.exists():
                rep.image(fig, f"margin-drop tightness ({name})")
        _commands(rep, commands, [f"tightness/{k}" for k, _ in margins])

    # Spectrum.
    spec = _read(out / "spectrum" / "spectrum.json")
    if spec:
        rep.heading("Spectra: vanilla versus MSVP")
        headers, rows = spectrum_rows(spec)
        if rows:
            labels = list(spec["weights"])
            lower = {
                lb: all(
                    r[f"lower: {lb}"]
                    for r in spec["comparison"]["rows"]
                    if r["matrix"] in ("W_q", "W_k", "W_v")
                )
                for lb in labels[1:]
            }
            rep.text(
                "Exact σ_max of the largest head per block (SpecFormer Fig. 2a). "
                + " ".join(
                    f"{lb} lowers the σ_max of every penalised matrix "
                    f"(W_q, W_k, W_v) in every block: "
                    f"**{'yes' if ok else 'no'}**."
                    for lb, ok in lower.items()
                )
            )
            rep.table(headers, rows)
        if (out / "spectrum" / "spectra.png").exists():
            rep.image(out / "spectrum" / "spectra.png", "weight spectra")
        rep.text(
            "Residual-branch Jacobians J_F (F = block − identity) at test inputs "
            "(Cauchy-problem paper Fig. 3, Tables 1–2): mean (std) of σ_max over "
            "the samples, and the mean of the upper bound √(‖J‖₁‖J‖∞) (eq. 16)."
        )
        rep.table(
            ["model", "block", "σ_max(J) mean (std)", "√(‖J‖₁‖J‖∞) mean", "σ_max"],
            jacobian_rows(spec),
        )
        if (out / "spectrum" / "jacobian.png").exists():
            rep.image(out / "spectrum" / "jacobian.png", "block Jacobian violins")
        dev = deviation_rows(spec)
        if dev:
            rep.text(
                "Deviation of the last block's output tokens for an image "
                "perturbation of ℓ2 norm ε: the first-order estimate "
                "ε·gain·exp(Σ_k σ_k) (Cauchy eq. 15; gain = ‖W_pe‖/min std, exact) "
                "and its discrete form ε·gain·Π_k(1 + σ_k) (σ_k = σ_max(J_F) of block "
                "k at the clean point; neither is a bound), the certified budget of "
                "the composed LoFAST bound at the same place (an upper bound) and PGD "
                "(a lower bound). Means over the samples."
            )
            rep.table(
                ["model", "ε", "ε·gain·exp(Σσ)", "ε·gain·Π(1+σ)", "certified", "PGD"],
                dev,
            )
        _commands(rep, commands, ["spectrum"])

    # Timings.
    steps = record.get("steps") or {}
    if steps:
        rep.heading("Timings")
        rep.table(
            ["step", "what it ran", "seconds", "status"],
            [[k, v.get("title", "–"), v.get("seconds"), v.get("status", "–")]
             for k, v in steps.items()],
        )
        text = f"Total over all steps: {fmt(record.get('total_seconds'))} s."
        if record.get("last_run_seconds") is not None:
            jobs = record.get("jobs", 1)
            text += (f" The last run: {fmt(record['last_run_seconds'])} s of wall "
                     f"time, {jobs} step{'s' if jobs > 1 else ''} at a time.")
        rep.text(text)
    return rep

"""The README's headline tables, generated from the committed results files.

One table per dataset, each between the markers ``<!-- table:NAME -->`` and
``<!-- /table:NAME -->`` of README.md, so that no figure of the README is
typed by hand:

- ``digits``: ``docs/figures/readme_figures.json``, written by
  ``python bench/user/readme_figures.py runs/demo --out docs/figures`` from the
  main job's run (``lipvit pipeline --out runs/demo``);
- ``fashion-mnist``: ``docs/figures/peer_lipschitz_cnn.json``, written by
  ``python bench/user/peer_lipschitz_cnn.py --out docs/figures``.

Usage::

    python bench/readme_tables.py           # rewrite README.md's tables
    python bench/readme_tables.py --check   # exit 1 if they differ (the tests run this)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
README = ROOT / "README.md"

DIGITS_METHODS = ("taylor", "lofast")
"""The sound methods of the digits table (``specformer`` certifies nothing
there and ``lofast-fast`` is an estimate: the caption says so)."""
LIPVIT_SYSTEM = re.compile(r"lipvit (\w+) \((\S+)\)")
"""A lipvit row's key in the results file: its architecture and the method
that ``lipvit certify`` picks for it (the bench certifies with that one)."""
ARCHITECTURES = {"hybrid": ("hybrid ViT", "fmnist-hybrid"),
                 "cait": ("CaiT", "fmnist-cait")}
"""lipvit's architectures: the row's name and the ``--preset`` that trains it;
the default of ``lipvit train --dataset fashion-mnist --family lipschitz`` is
marked."""
PEERS = {"torchlip CNN, hkr (per pair, sound L)": "deel-torchlip CNN, HKR",
         "torchlip CNN, lse (per pair, sound L)": "deel-torchlip CNN, LseHKR"}
"""The peers' rows: key in the results file → the row's name."""
DATE = re.compile(r",?\s*20\d\d-\d\d-\d\d")


def _load(name: str, figures: Path) -> dict[str, Any]:
    return json.loads((figures / name).read_text(encoding="utf-8"))


def _pct(value: float) -> str:
    return f"{100 * value:.1f} %"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def digits_table(figures: Path = FIGURES) -> str:
    """The digits table: the main job's lipschitz model, ``taylor`` and
    ``lofast`` per ε, median certified radius, seconds per sample."""
    fig = _load("readme_figures.json", figures)
    cert = fig["certify"]["lipschitz"]
    eps = sorted({r["eps"] for r in cert["results"]})
    by = {(r["method"], r["eps"]): r for r in cert["results"]}
    lines = [
        f"The main job's lipschitz model (`lipvit train --family lipschitz --msvp "
        f"1e-3`, {_pct(fig['training']['lipschitz']['test_acc'])} test accuracy) "
        f"on {cert['n']} test points (network's accuracy "
        f"{_pct(cert['clean_accuracy'])}): certified accuracy per ε, the median "
        f"certified radius over the correctly classified points and seconds per "
        f"point (with the method's set-up). `specformer` certifies "
        f"{_pct(max(by['specformer', e]['certified_accuracy'] for e in eps))} at "
        f"every ε; the main job took {fig['pipeline']['last_run_seconds']:.0f} s "
        f"on {fig['machine'].split(',')[0]} with {fig['machine'].split(', ')[2]}.",
        "",
        _row(["method", *(f"ε = {e:g}" for e in eps), "median radius", "s/point"]),
        _row(["---"] * (len(eps) + 3)),
    ]
    for method in DIGITS_METHODS:
        rows = [by[method, e] for e in eps]
        lines.append(_row([
            f"`{method}`", *(_pct(r["certified_accuracy"]) for r in rows),
            f"{cert['median_radius'][method]['radius']:.3g}",
            f"{rows[0]['seconds_per_sample']:.2g}"]))
    return "\n".join(lines)


def fmnist_table(figures: Path = FIGURES) -> str:
    """The Fashion-MNIST table: lipvit's models beside deel-torchlip's CNN on
    the same points; each column's best in bold."""
    res = _load("peer_lipschitz_cnn.json", figures)
    meta = res["_meta"]
    systems = fmnist_systems(res)
    eps = list(res[next(iter(systems))]["certified"])
    columns = {
        "clean": lambda r: r["clean"],
        **{f"ε = {e}": (lambda r, e=e: r["certified"][e]) for e in eps},
        "median certified radius": lambda r: r["median_radius"],
        "certified / attack radius": lambda r: r["median_cert_over_attack"],
    }
    best = {c: max(get(res[k]) for k in systems) for c, get in columns.items()}

    def cell(column: str, value: float) -> str:
        text = _pct(value) if column == "clean" or column.startswith("ε") else (
            f"{value:.3g}")
        return f"**{text}**" if value == best[column] else text

    lines = [
        f"Certified accuracy on the same {meta['n']} Fashion-MNIST test points "
        f"(attack radii on {meta['radius_n']}), one run on "
        f"{DATE.sub('', meta['machine'])}; no certified point breaks under "
        "PGD-ℓ2 or APGD:",
        "",
        _row(["system", *columns, "training"]),
        _row(["---"] * (len(columns) + 2)),
    ]
    for key, name in systems.items():
        r = res[key]
        lines.append(_row([name, *(cell(c, get(r)) for c, get in columns.items()),
                           f"{r['train_seconds'] / 60:.0f} min"]))
    return "\n".join(lines)


def fmnist_systems(res: dict[str, Any]) -> dict[str, str]:
    """The Fashion-MNIST table's rows, key in the results file → the row's
    name: lipvit's models (each with the method it was certified by; the
    default model marked), then the peers."""
    from lipvit.commands.train import DEFAULT_PRESET

    default = DEFAULT_PRESET["fashion-mnist", "lipschitz"]
    rows = {}
    for arch, (name, preset) in ARCHITECTURES.items():
        for key in res:
            match = LIPVIT_SYSTEM.fullmatch(key)
            if match and match[1] == arch:
                rows[key] = (f"lipvit {name}, `{match[2]}`"
                             + (" (the default)" if preset == default else ""))
    return rows | {key: name for key, name in PEERS.items() if key in res}


TABLES = {"digits": digits_table, "fashion-mnist": fmnist_table}


def block(name: str) -> re.Pattern:
    """The README's block of table ``name``, markers included."""
    return re.compile(rf"<!-- table:{name} -->.*?<!-- /table:{name} -->",
                      re.DOTALL)


def render(text: str, figures: Path = FIGURES) -> str:
    """``text`` (the README) with every table block regenerated."""
    for name, make in TABLES.items():
        pattern = block(name)
        if not pattern.search(text):
            raise ValueError(f"README.md has no <!-- table:{name} --> block")
        new = f"<!-- table:{name} -->\n{make(figures)}\n<!-- /table:{name} -->"
        text = pattern.sub(lambda _m, new=new: new, text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only compare; exit 1 if README.md differs")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    new = render(text)
    if args.check:
        if new != text:
            print("README.md's tables differ from the results files: run "
                  "python bench/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    print("rewrote README.md's tables: " + ", ".join(TABLES))
    return 0


if __name__ == "__main__":
    sys.exit(main())

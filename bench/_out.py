"""Where a bench writes: ``--out DIR`` (default ``runs/bench/<script>``), and in
it ``<script>.json`` with the numbers the script prints (figures beside it).

The scripts in ``bench/user/`` and ``bench/studies/`` put this folder on
``sys.path`` first (``python bench/user/x.py`` only puts ``bench/user/``
there), then import it and :mod:`_points`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def script(file: str) -> str:
    """The bench's name: its file name without ``.py``."""
    return Path(file).stem


def add_out(parser: argparse.ArgumentParser, file: str) -> None:
    """``--out DIR``: the folder the bench ``file`` writes its JSON (and
    figures) into, ``runs/bench/<script>`` by default."""
    name = script(file)
    parser.add_argument(
        "--out", type=Path, default=Path("runs/bench") / name,
        help=f"folder for {name}.json (and the figures of a bench that draws); "
             f"default runs/bench/{name}, created if missing")


def number(value: Any) -> Any:
    """``value`` as JSON can hold it: tensors and numpy scalars or arrays to
    floats or lists, paths to strings."""
    if hasattr(value, "tolist"):  # torch.Tensor, numpy arrays and scalars
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    return value


def _default(value: Any) -> Any:
    out = number(value)
    return str(out) if out is value else out


def write_json(out: Path, file: str, data: Any) -> Path:
    """Write ``data`` to ``out/<script>.json`` (``out`` created) and name the
    file on stderr, so that stdout stays what the bench prints."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{script(file)}.json"
    path.write_text(json.dumps(data, indent=2, default=_default) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return path


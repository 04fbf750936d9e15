"""Shared pieces of the CLI commands: options, loading, subsampling, parsing, writing.

Commands stay thin by taking these: click option decorators (``ckpt_option``,
``device_option``, ``n_option``, ...), :func:`load_checkpoint` and
:func:`load_test_set` (deterministic ``--n`` subsampling, the same samples for
every command), :func:`parse_floats` / :func:`parse_names` for comma lists, and
:func:`write_json` / :func:`write_csv`, which write atomically and refuse to
replace an existing file unless ``force`` (``--force``), or write to standard
output for the path ``-`` (with :func:`results_to_stdout` around the command,
whose text then goes to standard error). Errors are
``ValueError`` or :class:`lipvit.errors.LipvitError`, which the CLI group prints
as one line.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch
from torch import Tensor

from lipvit import files as _files
from lipvit.certify.eps import check_eps
from lipvit.data import default_dirs_text
from lipvit.errors import LipvitError

# Re-exported: the commands call them as ``C.atomic_path`` etc.
from lipvit.files import atomic_path as atomic_path
from lipvit.files import check_output_dir as check_output_dir
from lipvit.files import check_writable as check_writable
from lipvit.files import to_jsonable as to_jsonable
from lipvit.runtime import resolve_device as resolve_device

SUBSAMPLE_SEED = 0

# ---------------------------------------------------------------- options


def ckpt_option(multiple: bool = False) -> Callable:
    """``--ckpt PATH`` (required; repeatable with ``multiple``)."""
    return click.option(
        "--ckpt", "ckpt", required=True, multiple=multiple,
        type=click.Path(path_type=Path),
        help="checkpoint written by `lipvit train`, a transformers ViT directory "
        "or timm-layout weights (.safetensors/.pth with a .json beside)"
        + (" (repeatable)" if multiple else ""))


def threads_option(command: Callable) -> Callable:
    """``--threads N``: the CPU threads the command computes with (0: torch's
    default), restored when the command ends. Put it next to the function."""

    @functools.wraps(command)
    def run(*args, threads: int, **kwargs):
        if threads:
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            click.get_current_context().call_on_close(
                lambda: torch.set_num_threads(before))
        return command(*args, **kwargs)

    return click.option(
        "--threads", type=click.IntRange(min=0), default=0, show_default=True,
        help="CPU threads; 0: torch's default")(run)


device_option = click.option(
    "--device", default="auto", show_default=True,
    help="torch device: auto (cuda when available, else cpu), cpu, cuda, cuda:N")
n_option = click.option(
    "--n", "--samples", "n", type=click.IntRange(min=1), default=None,
    help="use N test samples (a fixed seeded subsample; default: all); spell it "
         "--samples after `torchrun ... -m lipvit`, whose parser takes --n for "
         "its own options")
batch_size_option = click.option(
    "--batch-size", type=click.IntRange(min=1), default=256, show_default=True,
    help="samples per batch")
force_option = click.option("--force", is_flag=True,
                            help="overwrite existing output files")
pdf_option = click.option("--pdf", is_flag=True, help="also write PDF figures")
# One meaning per option name (docs/cli.md, "Output options"): --json FILE and
# --csv FILE write the command's results to FILE, "-" meaning standard output;
# --out names the command's product (a checkpoint, a figure, a folder).
STDOUT = "-"
RESULTS_PATH = click.Path(dir_okay=False, allow_dash=True, path_type=Path)
json_option = click.option(
    "--json", "json_path", default=None, type=RESULTS_PATH, metavar="FILE",
    help="write the results as JSON to FILE (-: standard output, which then "
         "holds the JSON alone)")
csv_option = click.option(
    "--csv", "csv_path", default=None, type=RESULTS_PATH, metavar="FILE",
    help="write the results table as CSV to FILE (-: standard output, which "
         "then holds the CSV alone)")


def data_options(fn: Callable) -> Callable:
    """``--dataset`` and ``--data-dir``: override the checkpoint's dataset."""
    fn = click.option("--data-dir", default=None,
                      type=click.Path(file_okay=False, path_type=Path),
                      help="directory of a dataset that is not embedded "
                           f"[{default_dirs_text()}]")(fn)
    return click.option("--dataset", default=None,
                        help="dataset name (default: the checkpoint's)")(fn)


# ---------------------------------------------------------------- loading


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """Load a checkpoint (``lipvit.checkpoint.load_checkpoint``) on ``device``.

    Returns the ``Checkpoint`` record (``.model`` in eval mode, ``.config``,
    ``.dataset``, ``.summary``); a missing or corrupt file raises
    :class:`lipvit.errors.CheckpointError`.
    """
    from lipvit.checkpoint import load_checkpoint as _load

    if isinstance(device, str):
        device = resolve_device(device)
    return _load(Path(path), device=device)


def check_vit(loaded, command: str) -> None:
    """Refuse, in one line, a hybrid-ViT or CaiT checkpoint for ``command``,
    whose analyses need the ViT architecture (patch embedding, LoFAST layer
    bounds)."""
    from lipvit.errors import UnsupportedModelError

    arch = loaded.config.arch
    if arch != "vit":
        name = {"hybrid": "the hybrid ViT", "cait": "CaiT"}[arch]
        raise UnsupportedModelError(
            f"{command} analyses lipvit's ViT architecture; this checkpoint is "
            f"{name} (lipvit certify and lipvit attack take it)")


@dataclass(frozen=True, eq=False)
class TestSet:
    """Test images ``x`` ``(n, C, S, S)`` in ``[0, 1]``, labels ``y`` ``(n,)``,
    their positions ``index`` ``(n,)`` in the full test split, the dataset name
    and the name of every class (:attr:`lipvit.data.Dataset.class_names`)."""

    x: Tensor
    y: Tensor
    index: np.ndarray
    dataset: str
    num_classes: int
    class_names: tuple[str, ...] = ()


def subsample(total: int, n: int | None, seed: int = SUBSAMPLE_SEED) -> np.ndarray:
    """Sorted indices of ``n`` of ``total`` samples: a seeded permutation's first ``n``.

    The same ``(total, n)`` always gives the same samples, so ``certify``,
    ``attack`` and the analysis commands see the same points. ``n`` ``None``
    or ``≥ total`` gives all.
    """
    if n is None or n >= total:
        return np.arange(total)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return np.sort(np.random.default_rng(seed).permutation(total)[:n])


def load_test_set(ckpt: Any, *, n: int | None = None, dataset: str | None = None,
                  data_dir: str | os.PathLike | None = None,
                  device: str | torch.device = "cpu") -> TestSet:
    """The test split of the checkpoint's dataset (or ``dataset``), subsampled to ``n``.

    Raises:
        lipvit.errors.DataError: missing or malformed data.
        ValueError: images whose shape does not fit the model.
    """
    from lipvit.data import load_dataset

    if isinstance(device, str):
        device = resolve_device(device)
    name = dataset or ckpt.dataset
    if name is None:
        raise ValueError("the checkpoint records no dataset: pass --dataset")
    data = load_dataset(name=name, data_dir=data_dir, device=device)
    cfg = ckpt.config
    expected = (cfg.in_chans, cfg.image_size, cfg.image_size)
    if tuple(data.x_test.shape[1:]) != expected:
        got = tuple(data.x_test.shape[1:])
        raise ValueError(f"dataset {name!r} has images of shape {got}; "
                         f"the model expects {expected}")
    if cfg.num_classes != data.num_classes:
        raise ValueError(f"dataset {name!r} has {data.num_classes} classes; "
                         f"the model outputs {cfg.num_classes}")
    index = subsample(int(data.x_test.shape[0]), n)
    idx = torch.as_tensor(index, device=data.x_test.device)
    return TestSet(x=data.x_test[idx], y=data.y_test[idx], index=index,
                   dataset=data.name, num_classes=int(data.num_classes),
                   class_names=data.class_names)


# ---------------------------------------------------------------- parsing


def _parse_number(token: str) -> float:
    # "0.03", "1e-2" or a fraction such as "8/255".
    try:
        return float(Fraction(token)) if "/" in token else float(token)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"not a number: {token!r}") from None


def parse_floats(text: str | Sequence[str], name: str = "value", *,
                 allow_zero: bool = False) -> list[float]:
    """Comma-separated numbers (``"0.01,0.02"``, ``"2/255,8/255"``) as floats.

    Several option values (a repeated option) are joined. Every value must be
    finite and ``> 0`` (``≥ 0`` with ``allow_zero``).

    Raises:
        ValueError: empty list, unparsable, NaN, infinite or out-of-range values.
    """
    parts = [text] if isinstance(text, str) else list(text)
    tokens = [t.strip() for p in parts for t in p.split(",") if t.strip()]
    if not tokens:
        raise ValueError(f"no {name} given")
    values = []
    for token in tokens:
        values.append(check_eps(_parse_number(token), positive=not allow_zero,
                                name=name))
    return values


def parse_names(text: str | Sequence[str], choices: Iterable[str],
                name: str = "name") -> list[str]:
    """Comma-separated names, each one of ``choices``, in order, without duplicates."""
    choices = list(choices)
    parts = [text] if isinstance(text, str) else list(text)
    names = [t.strip().lower() for p in parts for t in p.split(",") if t.strip()]
    if not names:
        raise ValueError(f"no {name} given")
    for item in names:
        if item not in choices:
            raise ValueError(
                f"unknown {name} {item!r}; choose from {', '.join(choices)}")
    return list(dict.fromkeys(names))


def warn_large_eps(eps_list: Sequence[float], image_shape: Sequence[int]) -> None:
    """Warn (stderr) about ε beyond the diameter ``√(C·S·S)`` of ``[0, 1]^(C×S×S)``:
    such a ball contains every image, so the question is void."""
    diameter = math.sqrt(math.prod(image_shape))
    big = [e for e in eps_list if e > diameter]
    if big:
        click.echo(f"warning: eps {', '.join(f'{e:g}' for e in big)} exceeds the "
                   f"diameter {diameter:.4g} of the image space [0,1]^"
                   f"{'x'.join(map(str, image_shape))}: the ball holds every image",
                   err=True)


def format_eps(eps: float) -> str:
    """``0.03137 (8/255)`` for ε = k/255 with integer k ≤ 32; else ``0.03``."""
    k = eps * 255
    text = f"{eps:.4g}"
    if eps > 0 and abs(k - round(k)) < 1e-6 and round(k) <= 32:
        text += f" ({round(k)}/255)"
    return text


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain text table, columns padded; floats with 4 significant digits."""
    def cell(v: Any) -> str:
        if isinstance(v, float | np.floating):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(headers)]
    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))

    lines = [line(headers), line(["-" * w for w in widths]), *map(line, body)]
    return "\n".join(line.rstrip() for line in lines)


# ---------------------------------------------------------------- writing


def is_stdout(path: str | os.PathLike | None) -> bool:
    """Whether an output path is ``-``: standard output (``--json -``, ``--csv -``)."""
    return path is not None and os.fspath(path) == STDOUT


# The standard output of the command running under :func:`results_to_stdout`,
# while its text goes to standard error.
_results_stream: list[Any] = []


def _write_stdout(text: str) -> None:
    click.echo(text, nl=False, file=_results_stream[-1] if _results_stream else None)


def results_to_stdout(command: Callable) -> Callable:
    """With ``--json -`` or ``--csv -`` the results alone go to standard output:
    the command's text (tables, notes) goes to standard error meanwhile. Both
    ``-`` at once is refused. Put it next to the function, under the options;
    the command's parameters must be named ``json_path`` and ``csv_path``."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        dashes = [k for k in ("json_path", "csv_path") if is_stdout(kwargs.get(k))]
        if not dashes:
            return command(*args, **kwargs)
        if len(dashes) > 1:
            raise LipvitError("--json - and --csv - both ask for standard output; "
                              "write one of them to a file")
        _results_stream.append(sys.stdout)
        try:
            with contextlib.redirect_stdout(sys.stderr):
                return command(*args, **kwargs)
        finally:
            _results_stream.pop()

    return run


def check_results(paths: Iterable[str | os.PathLike | None], force: bool) -> None:
    """:func:`check_writable` for ``--json``/``--csv`` paths: ``-`` (standard
    output) is always writable."""
    check_writable([p for p in paths if not is_stdout(p)], force)


def write_json(path: str | os.PathLike, obj: Any, force: bool = False) -> Path:
    """:func:`lipvit.files.write_json`, or to standard output for ``-``."""
    if is_stdout(path):
        _write_stdout(json.dumps(to_jsonable(obj), indent=2, allow_nan=False) + "\n")
        return Path(path)
    return _files.write_json(path, obj, force)


def write_csv(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]],
              force: bool = False, columns: Sequence[str] | None = None) -> Path:
    """Write dict rows as CSV (columns: ``columns`` or keys in order of
    appearance); ``-``: to standard output."""
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: to_jsonable(v) for k, v in row.items()})
    if is_stdout(path):
        _write_stdout(buf.getvalue())
        return Path(path)
    with atomic_path(path, force) as tmp:
        tmp.write_text(buf.getvalue(), encoding="utf-8")
    return Path(path)


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file; a missing or malformed file is a one-line ``LipvitError``."""
    path = Path(path)
    if not path.is_file():
        raise LipvitError(f"{path}: no such file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LipvitError(f"{path}: not valid JSON ({err})") from None

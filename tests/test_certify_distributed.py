"""``torchrun -m lipvit certify`` on 2 CPU ranks (gloo): the merged JSON/CSV equal a
single-process run's (timing excluded), and an existing shard file is reused."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from lipvit.certify.evaluate import certify_samples, report_record

import lipvit
from lipvit.cli import main
from lipvit.commands._common import load_checkpoint, load_test_set
from lipvit.commands.certify import shard_settings
from lipvit.distributed import Ranks, load_shard, save_shard, shard_path, shard_slice
from lipvit.train import train, train_config_for

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--eps", "0.01,0.05", "--method", "lofast,lofast-fast", "--radius",
        "--samples", "10", "--batch-size", "3"]  # torchrun's parser takes --n
TIMING = "seconds_per_sample"  # timing: the only field that may differ
# MKL's float64 kernels may round the last bit differently with the memory
# alignment of a batch (seen: a margin 1 ulp apart between two runs of the
# same batch), so floats are compared to 1e-12 relative, all else exactly.
RTOL = 1e-12


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(
            map(_same, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=RTOL, abs=0)
    return type(a) is type(b) and a == b


@pytest.fixture(scope="module")
def ckpt(digits, tmp_path_factory):
    cfg = lipvit.preset("digits-tiny", family="lipschitz", mean=digits.mean,
                        std=digits.std)
    out = tmp_path_factory.mktemp("certify_distributed") / "lip.pt"
    train(cfg, train_config_for("lipschitz", epochs=1, device="cpu"), digits, out,
          progress=False)
    return out


def _certify(ckpt: Path, out: Path, ranks: int | None,
             args: list[str] = ARGS) -> subprocess.CompletedProcess | Result:
    """``lipvit certify`` writing ``out`` and its CSV: on ``ranks`` processes
    under torchrun, or (``None``) in this process, the reference."""
    cmd = ["certify", "--ckpt", str(ckpt), *args, "--json", str(out),
           "--csv", str(out.with_suffix(".csv"))]
    if ranks is None:
        result = CliRunner().invoke(main, cmd)
        assert result.exit_code == 0, result.output[-3000:]
        return result
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
              str(ranks)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run([sys.executable, *launch, "-m", "lipvit", *cmd], cwd=ROOT,
                            env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def single(ckpt, tmp_path_factory) -> Path:
    """A single-process run's JSON (its CSV beside it), run once: the reference
    the two-rank merge must equal and the run whose shard is resumed."""
    out = tmp_path_factory.mktemp("certify_single") / "single.json"
    _certify(ckpt, out, None)
    return out


def _without_timing(path: Path) -> dict:
    data = json.loads(path.read_text())
    for row in data["results"]:
        row.pop(TIMING)
    return data


def _csv_without_timing(path: Path) -> list[dict]:
    rows = list(csv.DictReader(path.open()))
    for row in rows:
        row.pop(TIMING)
    return rows


def test_shards_are_whole_batches_in_order():
    for n, batch, world in [(10, 3, 2), (7, 64, 3), (12, 2, 4), (5, 1, 8)]:
        slices = [shard_slice(n, batch, Ranks(r, world, r)) for r in range(world)]
        assert slices[0].start == 0 and slices[-1].stop == n
        for a, b in zip(slices, slices[1:], strict=False):
            assert a.stop == b.start
        assert all(s.start % batch == 0 for s in slices if s.stop > s.start)


@pytest.mark.slow
def test_two_ranks_merge_equals_single_process(ckpt, single, tmp_path):
    merged = tmp_path / "merged.json"
    out = _certify(ckpt, merged, 2)
    assert _same(_without_timing(merged), _without_timing(single))
    assert (_csv_without_timing(merged.with_suffix(".csv"))
            == _csv_without_timing(single.with_suffix(".csv")))
    assert out.stdout.count("clean accuracy") == 1  # rank 0 alone prints
    assert not list(tmp_path.glob("*.shard-*"))  # removed after the merge


def test_shard_with_other_settings_is_not_reused(tmp_path):
    path = tmp_path / "out.json.shard-0-of-2.json"
    save_shard(path, {"eps": [0.01]}, {"n": 0})
    assert load_shard(path, {"eps": [0.01]}) == {"n": 0}
    assert load_shard(path, {"eps": [0.02]}) is None
    path.write_text("{truncated")
    assert load_shard(path, {"eps": [0.01]}) is None


@pytest.mark.slow
def test_existing_shard_is_reused(ckpt, single, tmp_path):
    samples = json.loads(single.read_text())["samples"]
    # Rank 1's shard (samples 6..9) left by an interrupted run; one certificate
    # is flipped, so the merged output shows whether the file was reused.
    loaded = load_checkpoint(ckpt)
    data = load_test_set(loaded, n=10)
    ranks = Ranks(1, 2, 1)
    shard = shard_slice(10, 3, ranks)
    assert (shard.start, shard.stop) == (6, 10)
    methods, eps = ["lofast", "lofast-fast"], [0.01, 0.05]
    report = certify_samples(loaded.model.double(), data.x[shard].double(),
                             data.y[shard], methods, eps, radius=True)
    record = report_record(report)
    key = "lofast@0.05"
    record["certified"][key][0] = not record["certified"][key][0]
    out = tmp_path / "out.json"
    save_shard(shard_path(out, ranks),
               shard_settings(ckpt, data, shard, methods, eps, 1e-3, 3,
                              torch.device("cpu")), record)
    _certify(ckpt, out, 2)
    resumed = json.loads(out.read_text())["samples"]
    assert resumed[6]["certified"][key] == (not samples[6]["certified"][key])
    assert _same(resumed[:6], samples[:6]) and _same(resumed[7:], samples[7:])
    assert not shard_path(out, ranks).exists()


SMOOTHING = ["--eps", "0.05,0.2", "--method", "smoothing", "--sigma", "0.25",
             "--n0", "20", "--n-noise", "200", "--samples", "10", "--batch-size", "3"]


@pytest.mark.slow
def test_smoothing_two_ranks_merge_equals_single_process(ckpt, tmp_path):
    # Each point's noise is seeded by its test index, so the ranks' shards hold
    # exactly the counts of a single run; one JSON at the end.
    single, merged = tmp_path / "single.json", tmp_path / "merged.json"
    _certify(ckpt, single, None, SMOOTHING)
    out = _certify(ckpt, merged, 2, SMOOTHING)
    assert _same(_without_timing(merged), _without_timing(single))
    samples = json.loads(merged.read_text())["samples"]
    assert len(samples) == 10 and all(sum(s["smoothing"]["counts"]) == 200
                                      for s in samples)
    assert out.stdout.count("smoothed classifier: accuracy") == 1
    assert not list(tmp_path.glob("*.shard-*"))

"""CLI tests for `lipvit attack`, `lipvit plot certified` and `lipvit features`."""

from __future__ import annotations

import csv
import json
import re

import pytest
import torch
from click.testing import CliRunner

from lipvit.cli import main
from lipvit.commands import _common as C

pytest.importorskip("torchattacks")


@pytest.fixture(scope="module")
def ckpt(trained_ckpts):
    """The session's trained standard digits-tiny checkpoint (clean accuracy well
    above chance, so attacks have something to break)."""
    return trained_ckpts["standard"]


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def table_rows(output: str, header: str) -> list[list[str]]:
    """Rows of the printed table whose header line starts with ``header``."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.strip() or line.startswith(("wrote", "warning")):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def assert_one_line_error(result):
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.output


def test_attack_files_agree_with_table(ckpt, tmp_path):
    js, cs = tmp_path / "a.json", tmp_path / "a.csv"
    r = run("attack", "--ckpt", ckpt, "--attack", "fgsm,pgd", "--eps", "2/255,8/255",
            "--steps", "5", "--n", "40", "--json", js, "--csv", cs)
    assert r.exit_code == 0, r.output
    data = json.loads(js.read_text())
    assert data["n"] == 40 and data["norm"] == "linf" and data["dataset"] == "digits"
    assert data["attacks"] == ["fgsm", "pgd"] and data["settings"]["steps"] == 5
    rows = data["results"]
    assert [(x["attack"], x["eps"]) for x in rows] == [
        (a, e) for e in (2 / 255, 8 / 255) for a in ("fgsm", "pgd", "worst-case")]
    printed = table_rows(r.output, "attack")
    assert len(printed) == len(rows)
    for row, line in zip(rows, printed, strict=True):
        assert line[0] == row["attack"]
        assert line[1] == C.format_eps(row["eps"])
        assert line[2] == f"{row['robust_accuracy']:.4f}"
    with cs.open() as f:
        csv_rows = list(csv.DictReader(f))
    from_csv = [(x["attack"], float(x["eps"]), float(x["robust_accuracy"]))
                for x in csv_rows]
    assert from_csv == [(x["attack"], x["eps"], x["robust_accuracy"]) for x in rows]
    # Worst case ≤ every attack ≤ clean; per-sample records agree with the rates.
    for eps in (2 / 255, 8 / 255):
        acc = {x["attack"]: x["robust_accuracy"] for x in rows if x["eps"] == eps}
        assert acc["worst-case"] <= min(acc["fgsm"], acc["pgd"])
        assert max(acc.values()) <= data["clean_accuracy"]
        for name, value in acc.items():
            hits = [s["correct"][f"{name}@{eps}"] for s in data["samples"]]
            assert sum(hits) / 40 == pytest.approx(value)
    assert acc["pgd"] < data["clean_accuracy"]  # 8/255 breaks something
    index = [s["index"] for s in data["samples"]]
    assert index == sorted(set(index)) and max(index) < 360
    assert index == C.subsample(360, 40).tolist()  # the shared subsample
    # No silent overwrite; --force replaces.
    again = run("attack", "--ckpt", ckpt, "--eps", "0.01", "--n", "5", "--json", js)
    assert_one_line_error(again)
    assert "exists" in again.output and json.loads(js.read_text())["n"] == 40
    forced = run("attack", "--ckpt", ckpt, "--eps", "0.01", "--n", "5", "--json", js,
                 "--force")
    assert forced.exit_code == 0 and json.loads(js.read_text())["n"] == 5


def test_attack_preset(ckpt, tmp_path):
    js = tmp_path / "st.json"
    r = run("attack", "--ckpt", ckpt, "--threat", "specformer-st", "--n", "20",
            "--json", js)
    assert r.exit_code == 0, r.output
    data = json.loads(js.read_text())
    assert data["preset"] == "specformer-st" and data["attacks"] == ["fgsm", "pgd"]
    assert {x["eps"] for x in data["results"]} == {2 / 255}
    assert data["settings"]["steps"] == 2
    assert data["settings"]["alpha"] == pytest.approx(2 / 255)


@pytest.mark.parametrize("args", [
    ["--eps", "-0.1"],
    ["--eps", "nan"],
    ["--eps", "0.1", "--attack", "foo"],
    ["--eps", "0.1", "--attack", "pgd-l2"],  # an l2 attack under the linf default
    ["--attack", "pgd"],  # no eps
    ["--eps", "0.1", "--device", "cuda:7"] if not torch.cuda.is_available()
    else ["--eps", "0.1", "--device", "nonsense"],
])
def test_attack_bad_inputs(ckpt, args):
    assert_one_line_error(run("attack", "--ckpt", ckpt, "--n", "4", *args))


def test_attack_bad_checkpoints(tmp_path):
    missing = tmp_path / "missing.pt"
    assert_one_line_error(run("attack", "--ckpt", missing, "--eps", "1"))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    assert_one_line_error(run("attack", "--ckpt", bad, "--eps", "1"))


def _certify_json(path, scale):
    results = [{"method": m, "eps": e, "certified_accuracy": round(a * scale, 4),
                "seconds_per_sample": 0.01, "exact": m != "lofast-fast"}
               for m, acc in (("lofast", [0.8, 0.5, 0.2]),
                              ("lofast-fast", [0.82, 0.55, 0.25]))
               for e, a in zip((0.1, 0.2, 0.4), acc, strict=True)]
    samples = [{"index": i, "label": i % 10, "prediction": i % 10 if i < 9 else 0,
                "margin": 1.0, "radius": 0.05 * i, "certified": {}} for i in range(10)]
    path.write_text(json.dumps({"checkpoint": "x.pt", "dataset": "digits", "n": 10,
                                "clean_accuracy": 0.9, "results": results,
                                "samples": samples}))
    return path


def test_plot_certified(ckpt, tmp_path):
    a = _certify_json(tmp_path / "runA.json", 1.0)
    b = _certify_json(tmp_path / "runB.json", 0.5)
    att = tmp_path / "att.json"
    r = run("attack", "--ckpt", ckpt, "--attack", "pgd-l2", "--norm", "l2",
            "--eps", "0.2,0.5", "--n", "12", "--steps", "3", "--json", att)
    assert r.exit_code == 0, r.output
    out = tmp_path / "fig.png"
    r = run("plot", "certified", a, b, att, "--out", out, "--pdf")
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4] == b"\x89PNG" and out.with_suffix(".pdf").is_file()
    rows = {row[0]: row for row in table_rows(r.output, "curve")}
    assert set(rows) == {"runA: lofast", "runA: lofast-fast (estimate)", "runB: lofast",
                         "runB: lofast-fast (estimate)", "under attack (pgd-l2)"}
    assert rows["runA: lofast"][1:] == ["3", "0.8000"]
    assert rows["runB: lofast"][2] == "0.4000"
    # Radius curves: at r = 0 the fraction of correctly classified samples.
    out_r = tmp_path / "radius.png"
    r = run("plot", "certified", a, "--out", out_r, "--x", "radius")
    assert r.exit_code == 0, r.output
    (row,) = table_rows(r.output, "curve")
    assert row[0] == "certified radius" and row[2] == "0.9000" and out_r.is_file()
    # Per-method radii (what `lipvit certify --radius` writes): one curve each.
    data = json.loads(a.read_text())
    for s in data["samples"]:
        s["radii"] = {"lofast": s["radius"], "crown": 2 * s["radius"]}
    both = tmp_path / "both.json"
    both.write_text(json.dumps(data))
    r = run("plot", "certified", both, "--out", tmp_path / "both.png", "--x", "radius")
    assert r.exit_code == 0, r.output
    rows = table_rows(r.output, "curve")
    assert [row[0] for row in rows] == ["certified radius (lofast)",
                                        "certified radius (crown)"]
    assert_one_line_error(run("plot", "certified", a, "--out", out_r))  # exists


def test_plot_certified_bad_inputs(ckpt, tmp_path):
    out = tmp_path / "f.png"
    none = tmp_path / "none.json"
    assert_one_line_error(run("plot", "certified", none, "--out", out))
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    assert_one_line_error(run("plot", "certified", junk, "--out", out))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"results": [{"x": 1}]}))
    assert_one_line_error(run("plot", "certified", other, "--out", out))
    linf = tmp_path / "linf.json"
    assert run("attack", "--ckpt", ckpt, "--eps", "0.01", "--n", "4", "--steps", "1",
               "--json", linf).exit_code == 0
    cert = _certify_json(tmp_path / "c.json", 1.0)
    err = run("plot", "certified", cert, linf, "--out", out)
    assert_one_line_error(err)
    assert "linf" in err.output
    assert not out.exists()


def test_features_command(ckpt, tmp_path):
    out = tmp_path / "feat"
    r = run("features", "--ckpt", ckpt, "--out", out, "--n", "30", "--steps", "3")
    assert r.exit_code == 0, r.output
    assert (out / "tsne.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((out / "features.json").read_text())
    assert data["n"] == 30 and data["counts"] == {"clean": 30, "attacked": 30}
    assert data["attack"] == "pgd" and data["eps"] == pytest.approx(8 / 255)
    assert 0.0 <= data["a_distance"] <= 2.0
    assert data["a_distance"] == pytest.approx(
        2 * (1 - 2 * min(data["domain_classifier_error"], 0.5)))
    (row,) = table_rows(r.output, "A-distance")
    assert row[0] == f"{data['a_distance']:.4f}"
    assert row[3] == f"{data['attacked_accuracy']:.4f}"
    with (out / "tsne.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 60
    assert sum(x["source"] == "attacked" for x in rows) == 30
    assert {int(x["index"]) for x in rows} == set(C.subsample(360, 30).tolist())
    again = run("features", "--ckpt", ckpt, "--out", out, "--n", "30")
    assert_one_line_error(again)
    assert_one_line_error(run("features", "--ckpt", ckpt, "--out", tmp_path / "f2",
                              "--eps", "0.1,0.2"))

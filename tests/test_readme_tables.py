"""The README's headline tables are generated from the committed results files
(bench/readme_tables.py), so no figure there is typed by hand."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("readme_tables",
                                                  ROOT / "bench" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_tables_are_the_results_files(tables) -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert tables.render(text) == text, "run python bench/readme_tables.py"
    assert tables.main(["--check"]) == 0


def test_a_changed_result_changes_the_table(tables, tmp_path: Path) -> None:
    for name in ("readme_figures.json", "peer_lipschitz_cnn.json"):
        shutil.copy(ROOT / "docs" / "figures" / name, tmp_path / name)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    path = tmp_path / "peer_lipschitz_cnn.json"
    res = json.loads(path.read_text())
    res["lipvit hybrid (ball)"]["certified"]["0.25"] = 0.5
    path.write_text(json.dumps(res))
    assert "50.0 %" in tables.render(text, tmp_path)
    assert tables.render(text, tmp_path) != text



def test_the_default_model_is_marked(tables, monkeypatch) -> None:
    from lipvit.commands import train

    assert "hybrid ViT, `ball` (the default)" in tables.fmnist_table()
    monkeypatch.setitem(train.DEFAULT_PRESET, ("fashion-mnist", "lipschitz"),
                        "fmnist-cait")
    assert "CaiT, `margin` (the default)" in tables.fmnist_table()


def test_each_lipvit_row_names_the_method_it_was_certified_by(tables, tmp_path) -> None:
    res = json.loads((ROOT / "docs/figures/peer_lipschitz_cnn.json").read_text())
    cait = next(key for key in res if tables.LIPVIT_SYSTEM.fullmatch(key)
                and key.startswith("lipvit cait"))
    res["lipvit cait (global)"] = res.pop(cait)
    (tmp_path / "peer_lipschitz_cnn.json").write_text(json.dumps(res))
    table = tables.fmnist_table(tmp_path)
    assert "| lipvit CaiT, `global` |" in table
    assert table.count("lipvit CaiT") == 1
    rows = [table.index(name) for name in ("hybrid ViT", "CaiT", "deel-torchlip")]
    assert rows == sorted(rows)

"""Tests for lipvit.certify.eps: the one radius check of bounds, attacks, commands."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from lipvit.certify.eps import check_eps, check_eps_list, eps_per_sample

from lipvit.cli import main


@pytest.mark.parametrize("eps", [0, 0.5, 3, np.float32(0.25), torch.tensor(0.5),
                                 torch.tensor([2.0]), np.array(1.5)])
def test_numbers_pass_as_floats(eps):
    value = check_eps(eps)
    assert type(value) is float and value == float(np.asarray(eps).reshape(()))


@pytest.mark.parametrize("eps", [-0.1, math.nan, math.inf, -math.inf,
                                 torch.tensor(-1.0)])
def test_bad_values_are_value_errors_with_one_message(eps):
    with pytest.raises(ValueError, match=r"^eps must be finite and >= 0, got "):
        check_eps(eps)


@pytest.mark.parametrize("eps", ["0.1", None, True, [0.1]])
def test_non_numbers_are_type_errors(eps):
    with pytest.raises(TypeError, match="eps must be a number"):
        check_eps(eps)


def test_positive_and_name():
    assert check_eps(0.0) == 0.0
    with pytest.raises(ValueError, match=r"^alpha must be finite and > 0, got 0"):
        check_eps(0, positive=True, name="alpha")


def test_per_sample_shapes_and_dtype():
    e = eps_per_sample(0.5, 3, torch.float64, "cpu")
    assert e.shape == (3,) and e.dtype == torch.float64 and bool((e == 0.5).all())
    src = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float32)
    e = eps_per_sample(src, 3, torch.float64, "cpu")
    assert e.dtype == torch.float64 and torch.allclose(e, src.double())
    e[0] = 9.0  # a copy: the caller's tensor is untouched
    assert float(src[0]) == pytest.approx(0.1)
    assert eps_per_sample(torch.tensor([0.2]), 4, torch.float32, "cpu").shape == (4,)
    for bad in (torch.tensor([0.1, 0.2]), torch.zeros(3, 1)):
        with pytest.raises(ValueError, match="shape"):
            eps_per_sample(bad, 3, torch.float64, "cpu")
    with pytest.raises(ValueError, match="finite and >= 0"):
        eps_per_sample(torch.tensor([0.1, math.nan, 0.2]), 3, torch.float64, "cpu")
    with pytest.raises(TypeError):
        eps_per_sample(torch.tensor([True, False, True]), 3, torch.float64, "cpu")


def test_lists_need_one_positive_radius_each():
    assert check_eps_list([0.1, 2]).tolist() == [0.1, 2.0]
    with pytest.raises(ValueError, match="give at least one eps"):
        check_eps_list([])
    with pytest.raises(ValueError, match="finite and > 0"):
        check_eps_list([0.1, 0.0])


def test_cli_prints_the_same_message_in_one_line(tmp_path):
    r = CliRunner().invoke(main, ["certify", "--ckpt", str(tmp_path / "none.pt"),
                                  "--eps", "0.1,-1"])
    assert r.exit_code != 0 and "Traceback" not in r.output
    (error,) = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert "eps must be finite and > 0, got -1" in error

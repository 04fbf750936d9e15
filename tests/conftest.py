"""Shared fixtures and helpers for lipvit's tests.

Tests run on one CPU thread: their tensors are tiny (splitting them across
threads costs more than it saves) and spinning threads lose badly on a shared
machine.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

from lipvit.allocator import keep_freed_memory
from lipvit.config import ViTConfig
from lipvit.data import Dataset, load_dataset
from lipvit.model import ViT

keep_freed_memory()  # the tests compute as the lipvit program does (lipvit.allocator)

torch.set_num_threads(1)

# The slowest tests (by ``pytest --durations``), marked ``slow`` here in one
# place: ``pytest -m "not slow"`` is the quick run (every module still runs, at
# least its cheapest tests, most with their first seed or parameter; about 2
# minutes with ``-n auto`` on 2 cores), the plain ``pytest`` (CI) runs all.
# Patterns are fnmatch patterns on node ids (``[[]`` is a literal ``[``).
SLOW_TESTS = (
    "tests/test_pipeline.py::test_every_step_wrote_its_files",
    "tests/test_pipeline.py::test_report_tables_links_and_commands",
    "tests/test_pipeline.py::test_second_run_skips_everything",
    "tests/test_pipeline.py::test_missing_or_stale_outputs_rerun_only_their_steps",
    "tests/test_pipeline.py::test_changed_settings_are_refused_before_any_work",
    "tests/test_crown.py::test_logit_bounds_contain_sampled_and_attacked_points*",
    "tests/test_crown.py::test_margin_bounds_are_below_attacked_margins*",
    "tests/test_crown.py::test_certified_points_survive_attacks*",
    "tests/test_crown.py::test_huge_ball_gives_sound_possibly_vacuous_bounds*",
    "tests/test_certify.py::test_certified_points_survive_attacks*",
    "tests/test_certify.py::test_certified_radius_is_sound*",
    "tests/test_specformer.py::test_network_bound_sound_for_near_zero*",
    "tests/test_specformer.py::test_sound_when_input_norm_at_least_one[[][12]]",
    "tests/test_lofast.py::test_sound_adversarial_scalings[[][1-9]-*]",
    "tests/test_lofast.py::test_sound_random_layers[[][1-9]-*]",
    "tests/test_examples.py::test_tightness_plot",
    "tests/test_examples.py::test_import_hf_vit",
    "tests/test_attack_radius.py::test_affine_model_radius_is_the_boundary_distance"
    "[[]apgd-t-15]",
    "tests/test_attack_radius.py::test_affine_model_radius_is_the_boundary_distance"
    "[[]cw-1]",
    "tests/test_attack_radius.py::test_radius_is_a_verified_adversarial_distance",
    "tests/test_attack_radius.py::test_lofast_certified_radius_is_below_the_attack*",
    "tests/test_attacks.py::test_per_sample_consistency",
    "tests/test_symbols.py::test_stream_budgets_bound_pgd*",
    "tests/test_symbols.py::test_symbols_match_dense_jacobians[[][12]-*]",
    "tests/test_symbols.py::test_symbols_match_dense_jacobians[[]0-[12]]",
    "tests/test_symbols.py::test_tail_bound_covers_every_vertex[[][12]]",
    "tests/test_taylor.py::test_cli_certify_taylor",
    "tests/test_margin_second_order.py::test_class_attention_remainder_bounds_the_"
    "ascended_remainder[[]*-[12]]",
    "tests/test_margin_second_order.py::test_pair_moves_bound_the_class_tokens_pair_"
    "differences[[]*-[12]]",
    "tests/test_batched.py::test_taylor_of_a_batch_is_each_samples_alone[[]standard-*]",
    "tests/test_batched.py::test_taylor_of_a_batch_is_each_samples_alone[[]*-3]",
    "tests/test_taylor.py::test_subblock_norms_are_exact[[]lipschitz-token-*]",
    "tests/test_taylor.py::test_token_budgets_bound_pgd[[]0-standard-True]",
    "tests/test_taylor.py::test_margin_drop_bound_exceeds_pgd_on_every_class[[]0-standard-kw5]",
    "tests/test_taylor.py::test_stream_functionals_bound_pgd[[]kw2-0]",
    "tests/test_crown_standard.py::test_standard_family_runs_through_certify_samples*",
    "tests/test_fashion_mnist.py::test_pipeline_trains_and_certifies_the_hybrid",
    "tests/test_certify.py::test_report_counts_and_exact_flags[[]lipschitz]",
    "tests/test_crown.py::test_one_bounded_model_reused_over_samples_and_eps",
    "tests/test_taylor.py::test_taylor_certified_points_survive_pgdl2_and_apgd",
    "tests/test_taylor.py::test_margin_drop_bound_exceeds_pgd_on_every_class[[]1-*]",
    "tests/test_taylor.py::test_margin_drop_bound_exceeds_pgd_on_every_class"
    "[[]0-lipschitz-*]",
    "tests/test_taylor.py::test_attention_remainder_and_jacobian_bound_brute_force"
    "[[][34]-*]",
    "tests/test_taylor.py::test_token_budgets_bound_pgd[[]1-*]",
    "tests/test_examples.py::test_compare_attention",
    "tests/test_certify.py::test_radii_agree_with_per_eps_certificates*",
    "tests/test_certify.py::test_delta_out_bounds_pgd_on_whole_network*",
    "tests/test_cli_analysis.py::test_features_command",
    "tests/test_tightness.py::test_command_files_agree_with_table[[]target1]",
    "tests/test_structured.py::test_structured_route_sound_against_pgd[[][12]]",
    "tests/test_features.py::test_a_distance_separable_sets_is_two[[]1]",
    "tests/test_msvp.py::test_penalty_lowers_sigma_max_in_training[[]lipschitz]",
    "tests/test_compare.py::test_fast_run_writes_the_report",
    "tests/test_compare.py::test_rerun_reuses_models_and_evaluations",
    "tests/test_compare.py::test_changed_settings_are_refused_or_redone",
    "tests/test_subblock.py::test_structured_bound_never_lowers_the_radius[[]standard]",
    "tests/test_pipeline.py::test_jobs_rerun_in_parallel_processes_after_their_inputs",
    "tests/test_alpha_crown.py::test_margin_bounds_are_sound_and_at_least_crowns[[][12]-*]",
    "tests/test_alpha_crown.py::test_margin_bounds_are_sound_and_at_least_crowns[[]0-0.05]",
    "tests/test_alpha_crown.py::test_certified_points_survive_pgd[[][12]-*]",
    "tests/test_alpha_crown.py::test_crown_is_unchanged_after_alpha_crown_on_the_same_model"
    "[[][12]]",
    "tests/test_alpha_crown.py::test_certify_samples_and_cli[[][12]]",
    "tests/test_jets.py::test_taylor_with_jets_certifies_no_less_and_survives_pgd[[]1]",
    "tests/test_jets.py::test_margin_rest_and_drop_bound_pgd[[]*-[12]]",
    "tests/test_jets.py::test_margin_rest_and_drop_bound_pgd[[]0.1-0]",
    "tests/test_jets.py::test_cli_says_when_the_jets_do_not_fit",
    "tests/test_crown_standard.py::test_standard_certified_points_survive_attacks[[]1]",
    "tests/test_crown_standard.py::test_standard_logit_bounds_contain_sampled_and_attacked"
    "_points[[]1]",
    "tests/test_interop.py::test_commands_read_an_imported_model",
    "tests/test_taylor.py::test_margin_drop_bound_exceeds_pgd_on_every_class[[]0-standard-kw[46]]",
    "tests/test_tangents.py::test_bounds_are_not_changed_by_later_model_changes[[]standard]",
    # Issue 57: each covered in the quick run by the same test's first seed (or,
    # for the batch-independence variants, by the other push size and norms'
    # mode of each family).
    "tests/test_batched.py::test_taylor_of_a_batch_is_each_samples_alone[[]True-*-3]",
    "tests/test_batched.py::test_taylor_of_a_batch_is_each_samples_alone"
    "[[]False-*-None]",
    "tests/test_subblock.py::test_structured_subblock_norm_bounds_the_dense_jacobian"
    "[[][123]-*]",
    "tests/test_subblock.py::test_layernorm_subblock_norm_bounds_the_dense_jacobian"
    "[[][123]-*]",
    "tests/test_subblock.py::test_each_part_bounds_its_own_path[[][12]-*]",
    "tests/test_subblock.py::test_structured_subblock_norm_is_tight_for_uniform_attention"
    "[[][12]-*]",
    "tests/test_global_bound.py::test_attention_constant_bounds_ascended_jacobians"
    "[[]*-[12]]",
    "tests/test_global_bound.py::test_global_constant_bounds_ascended_jacobians"
    "[[][12]]",
    "tests/test_softmax_norm.py::test_weighted_norm_bounds_the_dense_softmax_path_for_any_weights"
    "[[][12]-*]",
    "tests/test_softmax_norm.py::test_descended_weights_tighten_the_standard_softmax_path"
    "[[][12]-*]",
    "tests/test_alpha_crown.py::test_logit_bounds_are_sound_and_at_least_crowns"
    "[[][12]]",
    "tests/test_alpha_crown.py::test_lipvit_operators_take_part_in_every_step[[][12]]",
    "tests/test_taylor.py::test_chord_intervals_hold_for_sampled_perturbations[[][12]]",
    "tests/test_taylor.py::test_third_order_remainder_brute_force[[]*-1]",
    "tests/test_taylor.py::test_attention_remainder_through_the_image_brute_force"
    "[[]*-1]",
    "tests/test_tightness.py::test_margin_bounds_sound_against_targeted_pgd[[]1]",
    "tests/test_crown_standard.py::test_standard_family_runs_through_certify_samples"
    "[[]1]",
    "tests/test_jets.py::test_quadratic_minimum_is_a_tight_lower_bound[[]*-[12]]",
    # The CLI's taylor options end to end; the quick run keeps what they rest
    # on: the memory planner's budgets and one-line refusal
    # (tests/test_tangents.py) and the symbols' bounds at any count
    # (tests/test_symbols.py).
    "tests/test_taylor.py::test_cli_max_memory",
    "tests/test_taylor.py::test_cli_max_symbols",
    # Each covered in the quick run by a sibling: alpha-CROWN on the lipschitz
    # family and CROWN on the standard one; the first ε of the same seed; the
    # other norms' mode of the standard family.
    "tests/test_alpha_crown.py::test_standard_family_alpha_crown_is_crown",
    "tests/test_alpha_crown.py::test_certified_points_survive_pgd[[]0-0.02]",
    "tests/test_batched.py::test_taylor_of_a_batch_is_each_samples_alone"
    "[[]True-standard-kw2-None]",
    # The wheel built, installed in a fresh venv and run (about 15 s).
    "tests/test_wheel.py::*",
)


@pytest.fixture(autouse=True)
def _same_rng_state_for_every_test() -> None:
    """Every test starts from the same torch RNG state, whatever ran before it
    in its process (``-n auto`` spreads the files over workers in an order
    that changes from run to run; the attacks' random starts draw from it)."""
    torch.manual_seed(0)


# The modules that take longest in the full run (``pytest --durations=0``,
# summed per file), longest first. ``-n auto`` hands out whole files in
# collection order (``--dist loadfile``), so these are collected first and the
# many short files fill the workers' ends: longest first keeps the two
# workers busy until the last seconds.
LONGEST_FIRST = (
    "test_taylor.py", "test_alpha_crown.py", "test_jets.py",
    "test_certify_distributed.py", "test_certify.py", "test_crown.py",
    "test_ball.py", "test_pipeline.py", "test_global_bound.py",
    "test_crown_standard.py", "test_subblock.py", "test_wheel.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if any(fnmatch.fnmatchcase(item.nodeid, p) for p in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


def tiny_config(family: str = "standard", **overrides) -> ViTConfig:
    """A very small ViT on 8×8 grayscale images (fast enough for every test)."""
    base = dict(
        image_size=8,
        in_chans=1,
        num_classes=10,
        patch_size=2,
        embed_dim=16,
        depth=2,
        num_heads=2,
        mlp_ratio=2.0,
        family=family,
    )
    return ViTConfig(**{**base, **overrides})


def nonlinear_model(family: str, seed: int, **overrides) -> ViT:
    """A float64 :func:`tiny_config` model with weights 3× their initial size
    (visibly nonlinear: what the certificates' remainder tests need)."""
    torch.manual_seed(seed)
    model = ViT(tiny_config(family, **overrides)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


@pytest.fixture(scope="session")
def digits() -> Dataset:
    """The full digits dataset (bundled with scikit-learn)."""
    return load_dataset("digits")


@pytest.fixture(scope="session")
def small_digits(digits: Dataset) -> Dataset:
    """400 training and 100 test digits (for quick training runs)."""
    return Dataset(
        digits.name,
        digits.x_train[:400],
        digits.y_train[:400],
        digits.x_test[:100],
        digits.y_test[:100],
        digits.num_classes,
        digits.mean,
        digits.std,
        digits.augment,
    )


def quick_train(model: torch.nn.Module, data: Dataset, steps: int,
                lr: float = 3e-3) -> torch.nn.Module:
    """``steps`` AdamW steps of cross-entropy on batches of 128 training images
    (the global RNG picks them); returns the model in eval mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        i = torch.randint(0, data.x_train.shape[0], (128,))
        loss = torch.nn.functional.cross_entropy(model(data.x_train[i]),
                                                 data.y_train[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


TRAINED_EPOCHS = {"lipschitz": 8, "standard": 4}


def shared_file(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """``name`` in a folder of this run that every xdist worker shares, made by
    ``build(path)`` once for the whole run: the first worker to ask builds it
    under a file lock, the others wait and read it (seeded trainings: the
    same file whichever worker builds it)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's base folder, above each worker's own
    path = root / "shared" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        if not path.exists():
            build(path)
    return path


@pytest.fixture(scope="session")
def trained_ckpts(digits: Dataset, tmp_path_factory) -> dict[str, Path]:
    """One digits-tiny checkpoint per family, trained once for the whole session.

    MSVP 1e-3 on q, k, v; 8 epochs (lipschitz) or 4 (standard): clean
    accuracy well above chance, and the standard model still certifies some
    points (longer training makes its bounds vacuous).
    Tests that need a trained model share these instead of training their own.
    """
    from lipvit.config import preset
    from lipvit.train import train, train_config_for

    paths = {}
    for family, epochs in TRAINED_EPOCHS.items():
        cfg = preset("digits-tiny", family=family, mean=digits.mean, std=digits.std)
        tcfg = train_config_for(family, epochs=epochs, device="cpu", msvp=(1e-3,) * 3)
        paths[family] = shared_file(
            tmp_path_factory, f"trained/{family}.pt",
            lambda path, cfg=cfg, tcfg=tcfg: train(cfg, tcfg, digits, path,
                                                   progress=False))
    return paths


@pytest.fixture(scope="session")
def trained_cait(digits: Dataset, tmp_path_factory) -> torch.nn.Module:
    """A small CaiT trained on digits against ``ball`` (seconds), float64, in
    eval mode (shared by the ``ball`` and ``margin`` tests)."""
    from lipvit.checkpoint import load_checkpoint
    from lipvit.config import preset
    from lipvit.train import train, train_config_for

    cfg = preset("fmnist-cait", image_size=8, embed_dim=16, stem_width=8,
                 head_hidden=32, cls_heads=4, cls_value_dim=8)
    tc = train_config_for("lipschitz", "digits", arch="cait", epochs=12,
                          batch_size=64, device="cpu", seed=0, cert_eps=0.1)
    out = shared_file(tmp_path_factory, "cait/c.pt",
                      lambda path: train(cfg, tc, digits, path, progress=False))
    return load_checkpoint(out).model.double().eval()


def noise_trained_vit(data: Dataset, sigma: float, steps: int) -> ViT:
    """A digits-tiny standard ViT trained ``steps`` AdamW steps under Gaussian
    noise of standard deviation ``sigma`` (for randomized smoothing), in eval
    mode."""
    torch.manual_seed(0)
    model = ViT(tiny_config("standard", mean=data.mean, std=data.std))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        i = torch.randint(0, data.x_train.shape[0], (128,))
        x = data.x_train[i] + sigma * torch.randn_like(data.x_train[i])
        loss = torch.nn.functional.cross_entropy(model(x), data.y_train[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def weakened_copy(module, target: str, edits, caller: str | None = None) -> Callable:
    """A deliberately weakened bound, for the tests that must catch it: function
    ``caller`` (default ``target``) of ``module`` run in a copy of the module's
    namespace, where every function of the module reads the copy, whose
    ``target`` has each ``(old, new)`` of ``edits`` applied (``old`` found
    exactly once in its source)."""
    import inspect
    import types

    source = inspect.getsource(getattr(module, target))
    for old, new in edits:
        assert source.count(old) == 1, f"{target} no longer reads {old!r}"
        source = source.replace(old, new)
    namespace = dict(vars(module))
    # Every function of the module reads the copy (a caller two calls away
    # from the target too).
    for name, fn in vars(module).items():
        if isinstance(fn, types.FunctionType) and fn.__globals__ is vars(module):
            namespace[name] = types.FunctionType(fn.__code__, namespace, fn.__name__,
                                                 fn.__defaults__, fn.__closure__)
    # compile inherits this file's ``from __future__ import annotations``, as the
    # module's own functions were compiled with it.
    exec(compile(source, module.__file__, "exec"), namespace)
    return namespace[caller or target]


def assert_survive_targeted_pgd(model: torch.nn.Module, x: Tensor, y: Tensor,
                                r: Tensor, steps: int = 40) -> None:
    """At each point and every wrong class ``j``, PGD-ℓ2 on ``F_j − F_y`` inside
    the ball of the point's radius ``r`` leaves the margin positive (what every
    certified radius must withstand)."""
    shape = (-1, 1, 1, 1)
    K = model(x[:1]).shape[1]
    j = torch.arange(K).repeat_interleave(len(y))  # every (class, point) at once
    i = torch.arange(len(y)).repeat(K)
    wrong = y[i] != j
    xs, ys, rs, js = x[i][wrong], y[i][wrong], r[i][wrong], j[wrong]
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(xs.shape, generator=gen, dtype=xs.dtype) * 1e-3
    for _ in range(steps):
        delta = delta.detach().requires_grad_(True)
        z = model(xs + delta)
        gap = z.gather(1, js[:, None])[:, 0] - z.gather(1, ys[:, None])[:, 0]
        (grad,) = torch.autograd.grad(gap.sum(), delta)
        with torch.no_grad():
            delta = delta + 0.2 * rs.reshape(shape) * grad / grad.flatten(1).norm(
                dim=1).clamp_min(1e-30).reshape(shape)
            delta = delta * (rs / delta.flatten(1).norm(dim=1)).clamp(
                max=1.0).reshape(shape)
    with torch.no_grad():
        z = model(xs + delta)
        broken = z.gather(1, js[:, None])[:, 0] >= z.gather(1, ys[:, None])[:, 0]
        assert not broken.any(), js[broken]


def pgd_lipschitz_ratio(
    fn: Callable[[Tensor], Tensor],
    x: Tensor,
    steps: int = 60,
    lr: float = 0.05,
    seed: int = 0,
) -> float:
    """Largest ``‖fn(a) − fn(b)‖ / ‖a − b‖`` that gradient ascent finds near ``x``.

    A lower bound of the Lipschitz constant of ``fn`` (ℓ2 over the whole
    tensor): both points are optimised from ``x`` and ``x`` plus a small random
    offset, with normalised-gradient steps on the log-ratio; the best ratio at
    any evaluated pair is returned.
    """
    g = torch.Generator().manual_seed(seed)
    a = x.clone().requires_grad_(True)
    b = (x + 1e-2 * torch.randn(x.shape, generator=g, dtype=x.dtype)).requires_grad_(
        True
    )
    best = 0.0
    for i in range(steps):
        num = torch.linalg.vector_norm(fn(a) - fn(b))
        den = torch.linalg.vector_norm(a - b)
        ratio = num / den
        best = max(best, float(ratio.detach()))
        ga, gb = torch.autograd.grad(torch.log(ratio), (a, b))
        step = lr * (0.98**i)
        with torch.no_grad():
            a += step * ga / ga.norm().clamp_min(1e-30)
            b += step * gb / gb.norm().clamp_min(1e-30)
    return best


def full_jacobian(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """Dense Jacobian of ``fn`` at ``x`` as a matrix ``(out.numel(), x.numel())``
    (every row's backward pass at once: ``vectorize``)."""
    J = torch.autograd.functional.jacobian(fn, x, vectorize=True)
    out_numel = J.numel() // x.numel()
    return J.reshape(out_numel, x.numel())


def share_jets(monkeypatch, cache: dict) -> None:
    """Make ``lipvit.certify.taylor.margin_jets.JetMargins`` build each second-order
    model once per ``cache``: the same weights, image, label and arguments give the same
    (deterministic, after construction read-only) object, so tests whose bounds need the
    same jets share them instead of rebuilding them."""
    import hashlib

    from lipvit.certify.taylor import margin_jets as jet_vit

    build = jet_vit.JetMargins

    def shared(model, x, y, *args, **kwargs):
        weights = hashlib.sha256()
        for name, t in model.state_dict().items():
            weights.update(name.encode())
            weights.update(t.detach().cpu().contiguous().numpy().tobytes())
        key = (weights.hexdigest(), str(x.dtype), tuple(x.shape),
               x.detach().cpu().contiguous().numpy().tobytes(), int(y), args,
               tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = build(model, x, y, *args, **kwargs)
        return cache[key]

    monkeypatch.setattr(jet_vit, "JetMargins", shared)

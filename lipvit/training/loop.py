"""The training loop: :func:`train` (checks, device, then :func:`_train`, the
epochs) and :func:`train_step`, one optimisation step.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lipvit.certified_training import CertifiedLoss, cert_eps_at
from lipvit.checkpoint import save_checkpoint
from lipvit.config import ViTConfig
from lipvit.data import Dataset, augment
from lipvit.errors import LipvitError
from lipvit.files import write_json
from lipvit.model import ViT, build_model
from lipvit.msvp import MSVP
from lipvit.runtime import cpu_threads
from lipvit.stability import ReLUStability
from lipvit.training.adversarial import pgd_attack
from lipvit.training.ball_loss import BallLoss
from lipvit.training.config import TrainConfig, _check_arch
from lipvit.training.device import _deterministic, _distributed, autocast_for
from lipvit.training.losses import margin_cross_entropy
from lipvit.training.margin_loss import MarginLoss
from lipvit.training.metrics import evaluate, sigma_summary
from lipvit.training.optim import _param_groups, lr_at
from lipvit.training.resume import _restore, _rng_state
from lipvit.training.summary import EpochLog, _summary, summary_path

Logger = Callable[[str], None]


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: Tensor,
    y: Tensor,
    cfg: TrainConfig,
    msvp: MSVP | None = None,
    *,
    stability: ReLUStability | None = None,
    cert: CertifiedLoss | BallLoss | MarginLoss | None = None,
    cert_eps: float = 0.0,
    net: nn.Module | None = None,
    generator: torch.Generator | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One optimisation step on the batch ``(x, y)`` (already augmented).

    PGD (if ``cfg.adv_train``), Gaussian noise of standard deviation
    ``cfg.noise_sd`` on the (attacked) images, forward,
    ``CE(loss_scale · logits) + MSVP`` (+ the ReLU-stability penalty of the
    forward pass, with ``stability``),
    backward, gradient clipping, optimizer step. The learning rate is whatever
    ``optimizer`` holds. Every parametrised (capped) weight is computed once
    per step (``parametrize.cached``) and shared by PGD, the forward pass and
    the penalty. With ``cert`` and ``cert_eps > 0`` the cross-entropy sees the
    logits of :meth:`CertifiedLoss.raised_logits` (one double backward pass).

    Args:
        model: the bare model (PGD and clipping use it).
        cert: the certified-training loss (:mod:`lipvit.certified_training`).
        cert_eps: its radius at this step (:func:`cert_eps_at`).
        net: what the forward pass calls (the DDP wrapper; default ``model``).

    Returns:
        ``(loss, penalty, logits)``, detached; ``penalty`` is 0 without MSVP.
    """
    net = model if net is None else net
    ctx = autocast if autocast is not None else contextlib.nullcontext
    with parametrize.cached():
        if cfg.adv_train != "none":
            x = pgd_attack(
                model,
                x,
                y,
                norm=cfg.adv_train[4:],
                eps=cfg.adv_eps,
                steps=cfg.adv_steps,
                loss_scale=cfg.loss_scale,
                generator=generator,
                autocast=ctx,
            )
        if cfg.noise_sd > 0:  # Gaussian data augmentation (Cohen et al. 2019, §4)
            x = x + cfg.noise_sd * torch.randn(x.shape, device=x.device,
                                               dtype=x.dtype, generator=generator)
        if stability is not None:
            stability.clear()  # PGD's forward passes do not count
        certifying = cert is not None and cert_eps > 0
        if certifying:
            cert.clear()
            x = x.detach().requires_grad_(True)
        with ctx(), cert.context() if certifying else contextlib.nullcontext():
            logits = net(x)
            seen = cert.raised_logits(logits, x, y, cert_eps) if certifying else logits
        loss = margin_cross_entropy(
            seen.float(), y, cfg.loss_scale, cfg.margin, cfg.label_smoothing
        )
        if certifying and cfg.cert_mix < 1:
            clean = margin_cross_entropy(
                logits.float(), y, cfg.loss_scale, cfg.margin, cfg.label_smoothing
            )
            loss = cfg.cert_mix * loss + (1 - cfg.cert_mix) * clean
        objective = loss if stability is None else loss + stability()
        if msvp is not None:
            penalty, _ = msvp()
            (objective + penalty).backward()
        else:
            penalty = torch.zeros((), device=x.device)
            objective.backward()
    if isinstance(cert, MarginLoss) and certifying and not all(
            torch.isfinite(p.grad).all() for p in model.parameters()
            if p.grad is not None):
        cert.skipped += 1  # a degenerate case of the bound's gradient: no step
        optimizer.zero_grad(set_to_none=True)
        return loss.detach(), penalty.detach(), logits.detach()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), penalty.detach(), logits.detach()


def train(
    model_cfg: ViTConfig,
    train_cfg: TrainConfig,
    dataset: Dataset,
    out: str | Path,
    *,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    log: Logger | None = None,
    init: ViT | None = None,
) -> dict[str, Any]:
    """Train a :class:`~lipvit.model.ViT` on ``dataset`` and save it to ``out``.

    Args:
        model_cfg: architecture; its image size, channels and classes must fit
            ``dataset``.
        train_cfg: how to train.
        dataset: the data (moved to the training device).
        out: checkpoint path; the summary goes to :func:`summary_path` ``(out)``.
        resume: continue from the checkpoint at ``out`` (same configurations);
            when there is none, start from scratch.
        force: overwrite an existing ``out`` (and its summary) from scratch.
        progress: show a tqdm bar per epoch (on stderr).
        log: receives one line per epoch (and a line on resume); library code
            never prints.
        init: start from this model's weights (fine-tuning, e.g. an imported
            transformers ViT); its configuration must be ``model_cfg``.

    Returns:
        The summary dict written next to the checkpoint: final accuracies,
        loss, MSVP penalty, exact σ_max statistics, timings, configurations and
        the per-epoch history.

    Raises:
        LipvitError: ``out`` exists and neither ``resume`` nor ``force`` is set,
            or the checkpoint to resume was made with other settings.
        ValueError: model and dataset do not fit.
    """
    out = Path(out)
    json_path = summary_path(out)
    if out.suffix == ".json":
        raise ValueError(
            f"--out {out} would collide with its JSON summary; use a .pt name"
        )
    if resume and force:
        raise ValueError("choose one of resume and force")
    if not (resume or force):
        for p in (out, json_path):
            if p.exists():
                raise LipvitError(
                    f"{p} exists; pass --resume to continue that run or "
                    "--force to overwrite it"
                )
    if (model_cfg.image_size, model_cfg.in_chans, model_cfg.num_classes) != (
        dataset.image_size,
        dataset.in_chans,
        dataset.num_classes,
    ):
        raise ValueError(
            f"model expects {model_cfg.in_chans}x{model_cfg.image_size}x"
            f"{model_cfg.image_size} images and {model_cfg.num_classes} classes; "
            f"dataset {dataset.name} has {dataset.in_chans}x{dataset.image_size}x"
            f"{dataset.image_size} and {dataset.num_classes}"
        )
    if init is not None and getattr(init, "config", None) != model_cfg:
        raise ValueError("init: the starting model's configuration is not model_cfg")
    emit = log if log is not None else (lambda line: None)

    rank, world, device = _distributed(train_cfg.device)
    if train_cfg.batch_size < world:
        raise ValueError(f"batch_size {train_cfg.batch_size} < world size {world}")
    emit_main = emit if rank == 0 else (lambda line: None)
    data = dataset.to(device)

    with (
        _deterministic(train_cfg.deterministic, device),
        cpu_threads(model_cfg, device, train_cfg.threads),
    ):
        return _train(
            model_cfg,
            train_cfg,
            data,
            out,
            json_path,
            resume,
            progress,
            emit_main,
            rank,
            world,
            device,
            init,
        )


def _train(
    model_cfg: ViTConfig,
    cfg: TrainConfig,
    data: Dataset,
    out: Path,
    json_path: Path,
    resume: bool,
    progress: bool,
    emit: Logger,
    rank: int,
    world: int,
    device: torch.device,
    init: ViT | None,
) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    _check_arch(model_cfg, cfg)
    model = build_model(model_cfg).to(device)
    if init is not None:
        model.load_state_dict(init.state_dict())
    msvp = (
        MSVP(model, cfg.msvp, cfg.msvp_iters, seed=cfg.seed).to(device)
        if any(cfg.msvp)
        else None
    )
    stability = (
        ReLUStability(model, cfg.relu_stability, cfg.stability_radius)
        if cfg.relu_stability > 0
        else None
    )
    cert = None
    if cfg.cert_eps > 0:
        if model_cfg.arch != "cait":
            cert = CertifiedLoss(model, cfg.cert_stream)
        else:
            cert = MarginLoss(model, cfg.cert_margin) if cfg.cert_margin else BallLoss(
                model)
    groups = _param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=cfg.lr)
    else:
        opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9, nesterov=True)

    n = data.x_train.shape[0]
    B = min(cfg.batch_size, n)
    steps_per_epoch = max(1, n // B)  # the last partial batch is dropped
    total_steps = cfg.epochs * steps_per_epoch
    warmup_steps = int(round(cfg.warmup * steps_per_epoch))

    start_epoch, history, elapsed = 0, [], 0.0
    if resume and out.exists():
        start_epoch, history, elapsed = _restore(
            out, model, msvp, opt, model_cfg, cfg, data, device
        )
        emit(f"resuming {out} after epoch {start_epoch}/{cfg.epochs}")
    elif resume:
        emit(f"no checkpoint at {out}; starting from scratch")

    net: nn.Module = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    autocast = autocast_for(device)

    from tqdm import tqdm

    gen = torch.Generator(device=device)
    step = start_epoch * steps_per_epoch
    extra: dict[str, Any] | None = None
    for epoch in range(start_epoch, cfg.epochs):
        t0, cpu0 = time.perf_counter(), time.process_time()
        model.train()
        # Batch order is shared by all ranks; augmentation and PGD starts are
        # per rank. Reseeding per epoch makes a resumed run replay exactly.
        gen.manual_seed(cfg.seed * 1_000_003 + epoch)
        perm = torch.randperm(n, device=device, generator=gen)
        gen.manual_seed((cfg.seed * 1_000_003 + epoch) * 1024 + rank + 1)
        loss_sum = torch.zeros((), device=device)
        pen_sum = torch.zeros((), device=device)
        correct = torch.zeros((), dtype=torch.long, device=device)
        cert_correct = torch.zeros((), dtype=torch.long, device=device)
        eps_now = 0.0
        seen = 0
        bar = tqdm(
            total=steps_per_epoch,
            desc=f"epoch {epoch + 1}/{cfg.epochs}",
            leave=False,
            disable=not progress or rank != 0 or not sys.stderr.isatty(),
            dynamic_ncols=True,
        )
        for i in range(steps_per_epoch):
            idx = perm[i * B : (i + 1) * B][rank::world]  # this rank's share
            x, y = data.x_train[idx], data.y_train[idx]
            if cfg.augment:
                x = augment(x, data.augment, gen)
            lr = lr_at(step, total_steps, warmup_steps, cfg.lr)
            for group in opt.param_groups:
                group["lr"] = lr
            if cert is not None:
                eps_now = cert_eps_at(step, total_steps, cfg.cert_eps, cfg.cert_warmup)
            loss, penalty, logits = train_step(
                model, opt, x, y, cfg, msvp, stability=stability, cert=cert,
                cert_eps=eps_now, net=net, generator=gen, autocast=autocast,
            )
            if cert is not None:
                cert_correct += ((logits.argmax(dim=-1) == y) & cert.certified()).sum()
            if msvp is not None:
                pen_sum += penalty
            loss_sum += loss * y.shape[0]
            correct += (logits.argmax(dim=-1) == y).sum()
            seen += y.shape[0]
            step += 1
            bar.update(1)
            if progress and i % 10 == 9:
                bar.set_postfix(loss=f"{float(loss):.3f}")
        bar.close()
        stats = torch.stack(
            [
                loss_sum,
                correct.to(loss_sum.dtype),
                torch.tensor(float(seen), device=device),
                pen_sum,
                cert_correct.to(loss_sum.dtype),
            ]
        )
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(stats)
            stats[3] /= world  # every rank computed the same penalty
        test_acc = evaluate(model, data.x_test, data.y_test)
        sig = sigma_summary(model)
        elapsed += time.perf_counter() - t0
        record = EpochLog(
            epoch=epoch + 1,
            loss=float(stats[0] / stats[2]),
            msvp_penalty=float(stats[3] / steps_per_epoch),
            train_acc=float(stats[1] / stats[2]),
            test_acc=test_acc,
            sigma_max_mean=sig["mean"],
            lr=lr,
            seconds=time.perf_counter() - t0,
            cpu_seconds=time.process_time() - cpu0,
            relu_unstable=None if stability is None else stability.take_unstable(),
            cert_eps=None if cert is None else eps_now,
            cert_acc=None if cert is None else float(stats[4] / stats[2]),
        )
        history.append(record._asdict())
        extra = {
            "epoch": epoch + 1,
            "step": step,
            "history": history,
            "elapsed": elapsed,
            "rng": _rng_state(device),
        }
        if rank == 0 and epoch + 1 < cfg.epochs:  # the last epoch is saved below
            save_checkpoint(
                out,
                model,
                train_config=cfg,
                msvp=msvp,
                optimizer_state=opt.state_dict(),
                extra=extra,
                dataset=data,
            )
        emit(record.line(cfg.epochs))
        if isinstance(cert, MarginLoss) and cert.skipped:
            emit(f"  {cert.skipped} steps skipped so far: the margin bound's "
                 "gradient was not finite")

    if stability is not None:
        stability.remove()
    if cert is not None:
        cert.remove()
    if extra is None:  # resumed a finished run: nothing trained
        extra = {
            "epoch": cfg.epochs,
            "step": step,
            "history": history,
            "elapsed": elapsed,
            "rng": _rng_state(device),
        }
    summary = _summary(
        model, model_cfg, cfg, data, out, history, elapsed, device, world
    )
    if rank == 0:
        save_checkpoint(
            out,
            model,
            train_config=cfg,
            msvp=msvp,
            optimizer_state=opt.state_dict(),
            extra=extra,
            summary=summary,
            dataset=data,
        )
        write_json(json_path, summary, force=True)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    return summary

"""Does an emitted module compute what the original model did?

:func:`verify` runs on every rank of a process group: one training step of the emitted
module against a single-process reference (the original model on the whole batch),
then ``steps`` optimizer steps of both. Losses, every gradient and every parameter are
compared with ``torch.testing.assert_close``. The reference trains in the plan's
precision too (autocast, the bf16 cast, fp16's loss scale: :mod:`flexsearch.emit.precision`),
and the tolerances are the precision's (:data:`TOLERANCES`). In fp32 they are tight and
elementwise. In a low precision every op rounds its result to the low dtype (to the
unit roundoff ``eps``: 2^-8 for bf16, 2^-11 for fp16), and a plan sums some results from
partial sums that were rounded first (a batch split, a tensor-parallel reduction), where
the single process rounds once: the two differ by a few roundings, which is large
relative to an element that cancels to near zero. So a low-precision tensor is compared
as a whole, ``||emitted - reference|| <= k eps ||reference||`` (2-norm): ``k = 4`` under
mixed precision (the matmuls' inputs rounded, everything else fp32), ``k = 8`` when
every op rounds (``bf16``: the relative error of a chain of ``L`` rounded ops grows like
``sqrt(L) eps``; 8 covers the zoo's 20-op blocks). Where the single process's own rounding
is larger, the bound is :data:`SPREAD` times it: the same step is also run in fp32, and a
tensor may differ from the low-precision reference by 4x the reference's distance from
that fp32 step, which draws the reference's random numbers (not for a model random in
training, below: the same draws need not give the same dropout masks in another dtype,
and the distance would be theirs). A sum of many nearly cancelling terms (a LayerNorm bias's gradient, a key
bias's, analytically zero) is mostly rounding in any low-precision order, and the plan's
order is another; a real fault moves well-conditioned tensors by far more than their
rounding. FSDP2 plans under mixed precision compute with their parameters gathered in the
low dtype (FSDP2's ``MixedPrecisionPolicy``), where autocast keeps LayerNorm's and the
biases' in fp32: their reference does the same (a copy of the model in the low dtype runs
the step, its gradients added to the fp32 ones). Tests and the fidelity benchmark use
it; ``flexsearch`` users can run it before a long job.

Decentralized (D-PSGD) plans compute something else on purpose: every rank keeps its
own model. From identical models, one step still has exact references: the mean over
ranks of the local gradients is the reference gradient, and the mean of the ranks'
models after the optimizer step is the reference model after one SGD step (mixing
identical models changes nothing; the mean of ``x - lr g_i`` is ``x - lr mean g_i``).
Later steps take gradients at different models, so only that first step is compared.
Each rank's loss is its own shard's (a mean over the labels it counts, with ignored
labels: not the whole batch's): the reference is the mean of the shards' losses.

Every rank runs every step before a mismatch is raised: ranks hold different tensors (a
pipeline's stages), and one that stopped at its own mismatch would leave the others
waiting for it in a collective. A model that is random in training (dropout, stochastic
depth: :func:`randomness`) differs from its reference whatever the plan, as the two draw
different random numbers; a mismatch then says so and how to check without it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flexsearch.emit.data import batch_shard, has_batch_norm
from flexsearch.emit.inputs import shard, split, step_loss
from flexsearch.emit.precision import autocast, backward, cast_inputs, cast_model
from flexsearch.plan import Plan
from flexsearch.precision import precision as precision_of
from flexsearch.strategy.kinds import FSDP_SHARDINGS

ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
TOLERANCES = {"fp32": (1e-4, 1e-5), "tf32": (1e-4, 1e-5), "bf16-mixed": (4 * ROUNDOFF["bfloat16"], 0.0),
              "fp16-mixed": (4 * ROUNDOFF["float16"], 0.0), "bf16": (8 * ROUNDOFF["bfloat16"], 0.0)}
"""Precision -> (rtol, atol): elementwise in fp32, norm-wise (``atol`` unused) in a
low precision (module docstring)."""


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` (2-norm; the absolute error when the
    reference is 0)."""
    a, b = actual.detach().float(), expected.detach().float()
    if a.shape != b.shape:
        return float("inf")
    err, ref = float((a - b).norm()), float(b.norm())
    return err / ref if ref else err


SPREAD = 4.0
"""In a low precision, how many times the single process's own rounding error (its
distance from the same step in fp32) the plan may differ from it by, where that is more
than the precision's tolerance (module docstring)."""


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, normwise: bool, msg,
           seen: list | None = None, what: str = "", exact: torch.Tensor | None = None) -> None:
    """Assert ``actual`` matches ``expected`` (module docstring); record its relative
    error under ``what`` in ``seen``. ``exact``: ``expected`` computed in fp32, the
    norm-wise bound then at least :data:`SPREAD` times ``||expected - exact||``."""
    if seen is not None and actual is not None and expected is not None:
        seen.append((relative_error(actual, expected), what))
    if not normwise:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=msg, check_dtype=False)
        return
    a, b = actual.detach().float(), expected.detach().float()
    if a.shape != b.shape:
        raise AssertionError(msg(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"))
    err, ref = float((a - b).norm()), float(b.norm())
    own = float((b - exact.detach().float()).norm()) if exact is not None else 0.0
    if not err <= max(rtol * ref + atol, SPREAD * own):
        raise AssertionError(msg(f"relative error {err / ref if ref else float('inf'):.3g} (2-norm) above "
                                 f"{max(rtol, SPREAD * own / ref if ref else 0.0):.3g} (the larger of the "
                                 f"precision's {rtol:.3g} and {SPREAD:g}x the single process's own error "
                                 f"against fp32, {own / ref if ref else float('inf'):.3g})"))


_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_RATE_WORDS = ("dropout", "drop_prob", "drop_rate", "drop_path", "pdrop", "layerdrop")
"""Attribute names of the rates functional dropout reads (Hugging Face models keep
``self.dropout = config.attention_dropout`` and call ``F.dropout(x, p=self.dropout)``)."""


def randomness(model: nn.Module) -> list[str]:
    """What draws random numbers in ``model``'s training step: its modules in training
    mode with a nonzero dropout-like rate (``nn.Dropout`` and its kin's ``p``; a float
    attribute named like a dropout rate, :data:`_RATE_WORDS`; the ``p`` of a module whose
    class is stochastic depth, ``*DropPath*`` or ``*StochasticDepth*``), one entry per
    class, attribute and rate: ``"Dropout p=0.1 in 4 modules"``."""
    found: dict[str, int] = {}
    for m in model.modules():
        if not m.training:
            continue
        cls = type(m).__name__
        if isinstance(m, _DROPOUT):
            rates = {"p": m.p}
        else:
            stochastic = "droppath" in cls.lower() or "stochasticdepth" in cls.lower()
            rates = {k: v for k, v in vars(m).items()
                     if isinstance(v, float)
                     and ((stochastic and k == "p") or any(w in k.lower() for w in _RATE_WORDS))}
        for k, v in rates.items():
            if v > 0:
                key = f"{cls} {k}={v:g}"
                found[key] = found.get(key, 0) + 1
    return [f"{key} in {n} module{'s' if n > 1 else ''}" for key, n in found.items()]


def randomness_hint(model: nn.Module) -> str:
    """The sentence a mismatch ends with when ``model`` is random in training
    (:func:`randomness`), else ``""``."""
    random = randomness(model)
    if not random:
        return ""
    shown = ", ".join(random[:3]) + (f" and {len(random) - 3} more" if len(random) > 3 else "")
    return (f"; the model is random in training ({shown}): the plan and the reference draw different random "
            "numbers, so they differ even when the plan is right. To check the plan, set these rates to 0 in the "
            "model file (e.g. dropout=0.0 in its config, or .eval() on those modules) and verify again")


def largest(seen: list, k: int = 5) -> list[tuple[float, str]]:
    """The ``k`` largest recorded relative errors, largest first."""
    return sorted(seen, key=lambda e: -e[0])[:k]


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor on this rank (gathered when distributed; None for ranks outside
    its mesh, which hold nothing)."""
    if isinstance(t, DTensor):
        f = t.full_tensor()
        return None if t.device_mesh.get_coordinate() is None else f
    return t


def statistics_groups(plan: Plan) -> int:
    """Into how many groups of samples ``plan`` splits the batch, each normalised with
    its own BatchNorm statistics (``batch_norm = "local"``): replicas times microbatches
    (data parallel and D-PSGD: the devices; pipelines: replicas x microbatches); a SOAP
    plan keeps the whole batch's statistics (DTensor gathers them)."""
    if plan.kind in ("data", "decentralized"):
        return plan.devices * (plan.microbatches or 1)
    if plan.kind in ("pipeline", "hybrid"):
        return (plan.stages[0].replicas if plan.stages else 1) * (plan.microbatches or 1)
    return 1


def _grad(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.grad


def original_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters of an emitted module under their names in the original model."""
    return dict(module.named_original_parameters())  # type: ignore[operator]


def verify(model: nn.Module, plan: Plan, inputs: tuple, target: Any = None,
           loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, *, steps: int = 3, lr: float = 0.05,
           group=None, rtol: float | None = None, atol: float | None = None) -> dict[str, Any]:
    """Emit ``plan`` for ``model`` and compare it with the original on this rank
    (tolerances: the precision's, module docstring, unless given).

    Raises AssertionError after every step ran (module docstring), naming the first
    mismatch, with the largest relative differences seen and, when the model is random
    in training, why (:func:`randomness_hint`); returns what was checked: ``loss``,
    ``reference_loss``, ``params`` (names this rank holds), ``largest`` (the five
    largest relative differences, ``(error, what)``) and ``module``, the emitted module
    after the steps (what it holds: its shards, its gradients of the last step)."""
    seen: list[tuple[float, str]] = []
    try:
        return _compare(model, plan, inputs, target, loss_fn, steps, lr, group, rtol, atol, seen)
    except AssertionError as e:
        worst = ", ".join(f"{what} {err:.2g}" for err, what in largest(seen, 3))
        raise AssertionError(f"{e}; largest relative differences: {worst}{randomness_hint(model)}") from None


def _compare(model, plan, inputs, target, loss_fn, steps, lr, group, rtol, atol, seen) -> dict[str, Any]:
    import torch.distributed as dist

    from flexsearch.emit import make_optimizer, parallelize

    prec = precision_of(plan.precision)
    rtol = TOLERANCES[plan.precision][0] if rtol is None else rtol
    atol = TOLERANCES[plan.precision][1] if atol is None else atol
    low = plan.precision not in ("fp32", "tf32")
    after = 1 if low else 10  # fp32: parameters after the steps compare 10x looser than gradients
    # D-PSGD: each rank's own mean loss (a mean over counted labels is its shard's), by design
    local = plan.kind == "decentralized" or (plan.batch_norm == "local" and has_batch_norm(model))
    groups = (plan.devices if plan.kind == "decentralized" else statistics_groups(plan)) if local else 1

    def reference(prec, gathered: str | None = None):
        """The single-process model in ``prec``, and its training step; ``gathered``: a
        dtype its parameters compute in, their gradients then added to the fp32 ones."""
        ref = cast_model(copy.deepcopy(model), prec)
        device_type = next((p.device.type for p in ref.parameters()), "cpu")

        def step() -> torch.Tensor:
            run = ref
            if gathered:  # the parameters in the low dtype (FSDP2 gathers them so), the buffers as they are
                run = copy.deepcopy(ref)
                for q in run.parameters():
                    q.data = q.data.to(getattr(torch, gathered))
            losses = []
            for k in range(groups):  # local batch statistics: the step as the mean over the plan's groups
                args, kwargs = split(shard(inputs, k, groups))
                with autocast(prec, device_type):
                    losses.append(step_loss(run(*cast_inputs(args, prec), **dict(zip(
                        kwargs, cast_inputs(kwargs.values(), prec), strict=True))), batch_shard(target, k, groups),
                        loss_fn))
            out = torch.stack(losses).mean() if groups > 1 else losses[0]
            backward(out, prec, run.parameters)
            if gathered:
                with torch.no_grad():
                    for p, q in zip(ref.parameters(), run.parameters(), strict=True):
                        if q.grad is not None:
                            p.grad = q.grad.float() if p.grad is None else p.grad + q.grad.float()
                    for b, c in zip(ref.buffers(), run.buffers(), strict=True):
                        b.copy_(c)
            return out

        return ref, step

    # FSDP2 under mixed precision computes with its parameters gathered in the low dtype
    # (its MixedPrecisionPolicy), where autocast keeps fp32 ones for LayerNorm and biases
    fsdp = plan.shard in FSDP_SHARDINGS if plan.kind == "data" else plan.shard == "zero2"
    ref, ref_step = reference(prec, prec.autocast if fsdp and prec.autocast else None)
    # in a low precision, the step in fp32 too: how far the single process's own rounding takes it;
    # not for a model random in training, whose fp32 step draws other random numbers (its distance
    # from the reference is then the randomness, not rounding, and would pass any plan)
    exact, exact_step = reference(precision_of("fp32")) if low and not randomness(model) else (None, lambda: None)

    def paired() -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reference step, then the fp32 one drawing the same random numbers (noise a
        forward draws, ``torch.randn``: the spread is then the rounding's)."""
        state = torch.get_rng_state()
        out = ref_step()
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        try:
            return out, exact_step()
        finally:
            torch.set_rng_state(after)

    mismatches: list[str] = []

    def check(compare: Callable[[], None]) -> None:  # recorded: raised once every step ran
        try:
            compare()
        except AssertionError as e:
            mismatches.append(str(e))

    def result() -> dict[str, Any]:
        if mismatches:
            more = f" (and {len(mismatches) - 1} more mismatch{'es' if len(mismatches) > 2 else ''})" \
                if len(mismatches) > 1 else ""
            raise AssertionError(mismatches[0] + more)
        return {"loss": float(loss), "reference_loss": float(ref_loss.detach()), "params": sorted(mine),
                "largest": largest(seen), "module": emitted}

    emitted = parallelize(model, plan, group=group)
    decentralized = plan.kind == "decentralized"
    loss = emitted.train_step(inputs, target, loss_fn)
    ref_loss, exact_loss = paired()
    if exact_loss is None:
        seen.append((relative_error(loss.float(), ref_loss.detach().float()), "loss"))
        check(lambda: torch.testing.assert_close(loss.float(), ref_loss.detach().float(), rtol=rtol, atol=atol,
                                                 msg=lambda m: f"loss differs: {m}"))
    else:
        check(lambda: _close(loss.reshape(1), ref_loss.reshape(1), rtol, atol, True, lambda m: f"loss differs: {m}",
                             seen, "loss", exact_loss.reshape(1)))
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    exact_params = dict(exact.named_parameters(remove_duplicate=False)) if exact is not None else {}
    mine = original_parameters(emitted)
    unknown = sorted(set(mine) - set(ref_params))
    if unknown:
        raise AssertionError(f"emitted parameters not in the original model: {unknown[:5]}")
    for name in sorted(mine):
        g = full(mine[name].grad)
        if decentralized and g is not None:  # local gradients: their mean is the reference
            g = g.clone()
            dist.all_reduce(g, group=group)
            g /= dist.get_world_size(group)
        if g is None and mine[name].grad is None and ref_params[name].grad is None:
            continue
        if g is None and isinstance(mine[name], DTensor) and mine[name].device_mesh.get_coordinate() is None:
            continue
        check(lambda g=g, name=name: _close(g, ref_params[name].grad, rtol, atol, low,
                                            lambda m: f"gradient of {name} differs: {m}", seen, f"gradient {name}",
                                            _grad(exact_params.get(name))))
    opt = make_optimizer(emitted, torch.optim.SGD, lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    exact_opt = torch.optim.SGD(exact.parameters(), lr=lr) if exact is not None else None
    opt.step()
    ref_opt.step()
    if exact_opt is not None:
        exact_opt.step()
    if decentralized:
        avg = emitted.average_parameters()
        for name in sorted(mine):
            check(lambda name=name: _close(avg[name], ref_params[name].detach(), rtol * after, atol * after, low,
                                           lambda m: f"mean of the ranks' {name} differs after one step: {m}",
                                           seen, f"parameter {name}", exact_params.get(name)))
        return result()
    for _ in range(steps - 1):
        opt.zero_grad()
        ref_opt.zero_grad()
        emitted.train_step(inputs, target, loss_fn)
        if exact_opt is not None:
            exact_opt.zero_grad()
        paired()
        opt.step()
        ref_opt.step()
        if exact_opt is not None:
            exact_opt.step()
    for name in sorted(mine):
        p = full(mine[name].detach())
        if p is None:
            continue
        check(lambda p=p, name=name: _close(p, ref_params[name].detach(), rtol * after, atol * after, low,
                                            lambda m: f"parameter {name} differs after {steps} steps: {m}", seen,
                                            f"parameter {name}", exact_params.get(name)))
    return result()


def verify_job(rank: int, world: int, spec: str, plan_json: str, steps: int) -> dict[str, Any]:
    """On every rank of ``flexsearch verify``: the model file ``spec`` and the plan,
    trained on the model's own loss or :func:`~flexsearch.emit.inputs.default_objective`'s;
    ``ok`` and the largest differences, or the first mismatch."""
    from flexsearch.emit.inputs import default_objective
    from flexsearch.model_files import load_model

    torch.manual_seed(0)  # every rank builds the same model, whatever the file seeds (DDP and FSDP take rank 0's)
    model, inputs = load_model(spec)
    plan = Plan.model_validate_json(plan_json)
    target, loss_fn = default_objective(model, inputs)
    try:
        got = verify(model, plan, inputs, target, loss_fn, steps=steps)
    except AssertionError as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True, "loss": got["loss"], "reference_loss": got["reference_loss"], "largest": got["largest"],
            "own_loss": loss_fn is None}

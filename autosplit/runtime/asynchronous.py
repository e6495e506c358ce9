"""Asynchronous pipeline schedules over a plan's chain of stages: XPipe, plain asynchronous, and
PipeDream's weight stashing (DESIGN §4.7; Guan et al. 2019, Narayanan et al. 2019).

``torch.distributed.pipelining`` flushes the pipeline every step, so these run on a loop of
our own over the same stage modules (codegen's chain form: stage ``s`` receives only from
``s − 1`` and sends only to ``s + 1``, tensors by position, static shapes). Each rank runs its
stage's work in the order :func:`autosplit.solver.asynchronous.async_order` gives — ``S − s``
micro-batches in flight, then one backward and one forward in turn, across mini-batches —
and updates its weights after each mini-batch's last backward. Activations go forward with
``isend``, gradients come back the same way; a rank blocks only on ``recv``, and the
simulated order has no cycle, so no two ranks wait on each other.

What a forward and a backward see, for a micro-batch whose forward runs ``s`` updates before
the update its gradient is applied to (the version difference, read off the simulation):

- ``"xpipe"``: the forward runs on the weights predicted for then, ``Ŵ = W − lr · s · Δ``
  (:mod:`autosplit.runtime.prediction`); the backward on the weights of its time, which are
  the ones the forward predicted. One weight copy: ``Ŵ`` lives only during the forward.
- ``"async"``: the forward on the current weights, the backward on the weights of its time
  (updated since): the inconsistency the other two remove.
- ``"pipedream"``: forward and backward on the same weights: the version the forward saw is
  stashed until the micro-batch's backward (one copy per version in flight).

All three agree where no update falls between a micro-batch's forward and its backward (the
last stage, always). Backwards read the weights of their time through saved-tensor hooks that
keep the parameters themselves rather than a checked snapshot; ``tests/runtime/test_async_pipeline.py``
checks each schedule against these rules applied to the unsplit model in one process.

Usage (every rank, under ``torchrun``)::

    pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(x,), loss_fn=loss_fn,
                                schedule="xpipe", micro_batches=4)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    losses = pipe.run(batches, optimizer=opt)   # [(inputs, target), ...]; losses on the last stage
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autosplit import schedules
from autosplit.errors import AutosplitError, DistributedError, advice, causes
from autosplit.microbatch import split_batch, split_target
from autosplit.passes.chain import Chain
from autosplit.runtime.batches import describe, shapes
from autosplit.runtime.prediction import predicted, update_direction
from autosplit.solver.asynchronous import Simulation, simulate

__all__ = ["AsynchronousRun", "check_optimizer", "run_asynchronous"]



def _keep_live(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def _backward_reads_live_weights() -> Iterator[None]:
    """Tensors saved for backward are the tensors themselves, unchecked: a backward after an
    update reads the updated weights instead of failing autograd's version check."""
    with torch.autograd.graph.saved_tensors_hooks(_keep_live, _keep_live):
        yield


class _Stash:
    """PipeDream's stashed weight versions: one leaf copy per version some micro-batch in flight used."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter]):
        self.params = params
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.users: dict[int, int] = {}
        self.peak = 0
        """The most copies held at once."""

    def take(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self.versions:
            self.versions[version] = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.params.items()}
            self.peak = max(self.peak, len(self.versions))
        self.users[version] = self.users.get(version, 0) + 1
        return self.versions[version]

    def give_back(self, version: int) -> None:
        """After a stashed micro-batch's backward: its weight gradients into the parameters."""
        with torch.no_grad():
            for name, copy in self.versions[version].items():
                if copy.grad is not None:
                    p = self.params[name]
                    p.grad = copy.grad.clone() if p.grad is None else p.grad.add_(copy.grad)
                    copy.grad = None
        self.users[version] -= 1
        if self.users[version] == 0:
            del self.versions[version], self.users[version]


def run_asynchronous(
    *, schedule: str, chain: Chain, stage: int, stages: int, module: torch.nn.Module, device: torch.device,
    batches: Sequence[tuple[list[Any], Any]], micro_batches: int, optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor], peers: tuple[int | None, int | None] = (None, None),
) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    """Train on ``batches`` (each: the model's flat inputs and the target) with ``schedule``;
    returns each mini-batch's mean loss on the last stage (``None`` elsewhere) and what the run
    kept (the most weight copies PipeDream stashed at once, the version differences of this
    stage's forwards, when each mini-batch's update ended: ``time.perf_counter()``)."""
    M, B = micro_batches, len(batches)
    sim: Simulation = simulate(stages=stages, micro_batches=M, mini_batches=B, forward=[1.0] * stages, backward=[2.0] * stages)
    previous, following = peers
    params = dict(module.named_parameters())
    stash = _Stash(params)
    micro: dict[int, list[tuple[tuple, dict]]] = {}
    targets: dict[int, list[Any]] = {}
    in_flight: dict[tuple[int, int], dict[str, Any]] = {}
    losses: list[list[torch.Tensor]] = [[] for _ in range(B)]
    sends: list[Any] = []
    updated: list[float] = []  # when each mini-batch's update ended here (perf_counter)
    last = stage == stages - 1
    grad_flags = [t.requires_grad for t in chain.inputs_meta[stage]]
    out_flags = [t.requires_grad for t in chain.inputs_meta[stage + 1]] if not last else []

    def chunks(b: int) -> list[tuple[tuple, dict]]:
        if b not in micro:
            flat, target = batches[b]
            named = dict(zip(chain.input_names, flat))
            micro[b] = split_batch((), named, M)
            if last:
                targets[b] = split_target(target, M)
        return micro[b]

    for work in sim.order[stage]:
        b, m = work.mini, work.micro
        if work.kind == "update":
            optimizer.step()
            optimizer.zero_grad()
            updated.append(time.perf_counter())
            micro.pop(b, None)
            targets.pop(b, None)
            continue
        if work.kind == "forward":
            _, named = chunks(b)[m]
            received = _receive(chain.inputs_meta[stage], grad_flags, previous, device)
            version_gap = sim.version_difference(stage, b, m)
            out, version = _forward(schedule, module, params, optimizer, stash, version_gap, b, received, named)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            state: dict[str, Any] = {"received": received, "version": version}
            if last:
                loss = loss_fn(chain.output(outs), targets[b][m]) / M
                state["loss"] = loss
                losses[b].append(loss.detach() * M)
            else:
                for t in outs:
                    sent = t.detach().contiguous()
                    sends.append((dist.isend(sent, dst=following), sent))
                state["outs"] = outs
            in_flight[b, m] = state
            continue
        state = in_flight.pop((b, m))  # backward
        if last:
            state["loss"].backward()
        else:
            _backward_from(following, state["outs"], out_flags, device)
        if state["version"] is not None:
            stash.give_back(state["version"])
        if stage > 0:
            sends += [(dist.isend(g, dst=previous), g) for g in _input_gradients(state["received"], grad_flags)]
        sends = [(w, t) for w, t in sends if not w.is_completed()]
    for w, _ in sends:
        w.wait()
    report = {"stashed_copies": stash.peak, "version_differences": sim.differences(stage), "update_times": updated}
    return [torch.stack(ls).mean() if last else None for ls in losses], report


def _receive(metas: Sequence[torch.Tensor], grad_flags: Sequence[bool], src: int | None, device: torch.device) -> list[torch.Tensor]:
    """A forward's inputs from the previous stage, in order, each requiring grad as the stage's inputs do."""
    received = []
    for meta, wants_grad in zip(metas, grad_flags):
        buf = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        dist.recv(buf, src=src)
        received.append(buf.requires_grad_(wants_grad))
    return received


def _backward_from(following: int | None, outs: Sequence[torch.Tensor], out_flags: Sequence[bool], device: torch.device) -> None:
    """Receive the gradients of this stage's outputs from the next stage and run the backward from them."""
    roots, seeds = [], []
    for t, wants_grad in zip(outs, out_flags):
        if wants_grad:
            g = torch.empty(t.shape, dtype=t.dtype, device=device)
            dist.recv(g, src=following)
            if t.requires_grad:
                roots.append(t)
                seeds.append(g)
    if roots:
        torch.autograd.backward(roots, seeds)


def _input_gradients(received: Sequence[torch.Tensor], grad_flags: Sequence[bool]) -> list[torch.Tensor]:
    """The gradients of the inputs the previous stage sent (zeros for one the backward did not reach)."""
    return [(t.grad if t.grad is not None else torch.zeros_like(t)).contiguous() for t, wants in zip(received, grad_flags) if wants]


def _forward(
    schedule: str, module: torch.nn.Module, params: Mapping[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer,
    stash: _Stash, gap: int, mini: int, received: list[torch.Tensor], named: dict[str, Any],
) -> tuple[Any, int | None]:
    """The stage's forward on the weights ``schedule`` gives it (:attr:`~autosplit.schedules.Schedule.weights`);
    the stashed version it used, if any."""
    weights = schedules.lookup(schedule).weights
    if weights == "stashed":
        if gap == 0:  # no update comes before this micro-batch's backward: nothing to stash
            return module(*received, **named), None
        version = mini - gap
        return torch.func.functional_call(module, stash.take(version), tuple(received), named), version
    with _backward_reads_live_weights():
        if weights == "current" or gap == 0:
            return module(*received, **named), None
        # xpipe: the weights predicted for the update this mini-batch's gradient is applied to,
        # written into the parameters for the forward only.
        with torch.no_grad():  # read only to overwrite the parameters: no graph
            guess = predicted(optimizer, gap)
        kept = {n: p.detach().clone() for n, p in params.items() if guess.get(p, p) is not p}
        try:
            with torch.no_grad():
                for n in kept:
                    params[n].copy_(guess[params[n]])
            return module(*received, **named), None
        finally:
            with torch.no_grad():
                for n, value in kept.items():
                    params[n].copy_(value)


def check_optimizer(schedule: str, optimizer: torch.optim.Optimizer) -> None:
    """XPipe needs an optimizer it can read a direction from (a typed error otherwise, before any work)."""
    if schedules.lookup(schedule).weights == "predicted":
        for group in optimizer.param_groups:
            for p in group["params"][:1]:
                update_direction(optimizer, p)


class AsynchronousRun:
    """The asynchronous training of :class:`~autosplit.runtime.distributed.DistributedModel`: its
    :meth:`run` over this module's loop."""

    plan: Any
    chain: Chain
    layout: Any
    module: torch.nn.Module
    device: torch.device
    micro_batches: int
    asynchronous: str | None
    last_run: dict[str, Any]
    _to_flat: Callable[..., list[Any]]
    _input_names: tuple[str, ...]
    _shapes: Any
    _rows: int | None
    _loss_of_output: Callable[[Any, Any], torch.Tensor]
    _failed: str | None
    _rank: int

    if TYPE_CHECKING:  # DistributedModel's

        def _usable(self) -> None: ...

    def run(self, batches: Sequence[Any], *, optimizer: torch.optim.Optimizer) -> list[torch.Tensor | None]:
        """Train on ``batches`` — each ``(inputs, target)`` or ``(inputs, kwargs, target)``, one
        mini-batch of the example's shape — with this pipeline's asynchronous schedule (no flush
        between mini-batches; see :mod:`autosplit.runtime.asynchronous`). Call it on every rank
        with the same batches. The runtime steps ``optimizer`` (over
        :meth:`~autosplit.runtime.distributed.DistributedModel.parameters`) after each mini-batch's
        last backward and zeroes its gradients. Returns each mini-batch's loss on the last stage's
        rank, ``None`` elsewhere; :attr:`last_run` says what the run kept."""
        self._usable()
        if self.asynchronous is None:
            raise DistributedError(advice(
                "run() trains with asynchronous schedules, and this pipeline flushes every step",
                f"its plan's schedule is {self.plan.schedule!r}",
                "call step() per batch, or distribute with schedule='xpipe', 'async' or 'pipedream'",
            ))
        check_optimizer(self.asynchronous, optimizer)
        flat_batches = []
        for i, item in enumerate(batches):
            inputs, kwargs, target = item if len(item) == 3 else (item[0], {}, item[1])
            inputs = inputs if isinstance(inputs, tuple) else (inputs,)
            flat = self._to_flat(inputs, dict(kwargs))
            # Every rank is given the same batches, so every rank refuses the same one, before any compute.
            rows = int(target.shape[0]) if isinstance(target, torch.Tensor) and target.dim() > 0 else None
            if shapes(flat) != self._shapes or (self._rows is not None and rows != self._rows):
                got = [f"{n}: {describe(v)}" for n, v in zip(self._input_names, shapes(flat))]
                want = [f"{n}: {describe(v)}" for n, v in zip(self._input_names, self._shapes)]
                raise DistributedError(advice(
                    f"mini-batch {i} of {len(batches)} has inputs {got} and a target of {rows} rows, where the "
                    f"example has {want} and {self._rows} rows",
                    "an asynchronous pipeline runs every mini-batch with the example's shapes: its receive "
                    "buffers and its simulated schedule are fixed when it starts",
                    "give run() mini-batches of the example's shape (DataLoader(drop_last=True)); train a last "
                    "partial batch with a flushed pipeline (schedule='gpipe' or '1f1b'), or drop it",
                ))
            flat_batches.append((flat, target))
        stage, stages = self.layout.stage, self.layout.stages
        peers = (self.layout.rank(stage - 1) if stage > 0 else None, self.layout.rank(stage + 1) if stage < stages - 1 else None)
        try:
            losses, self.last_run = run_asynchronous(
                schedule=self.asynchronous, chain=self.chain, stage=stage, stages=stages, module=self.module,
                device=self.device, batches=flat_batches, micro_batches=self.micro_batches, optimizer=optimizer,
                loss_fn=self._loss_of_output, peers=peers,
            )
        except AutosplitError:
            raise
        except Exception as e:
            self._failed = causes(e)
            raise DistributedError(advice(
                f"rank {self._rank} (stage {stage} of {stages}) failed during asynchronous training: {causes(e)}",
                "an error in this stage's forward/backward, or a peer rank that failed or exited",
                "look for the first rank that failed; run the model unsplit on one batch to reproduce",
            )) from e
        return losses

"""Where this rank's stage lives: its place on the device mesh, its device, the data-parallel
wrapping of its module, and the model's state no stage reads.

The mesh is torchtitan's ``("pp", "dp_replicate", "dp_shard", "tp")`` (:func:`make_mesh`), pp
outermost and tp innermost, with the degrees the plan records
(:attr:`~autosplit.plans.Plan.mesh`): rank ``((p · dp_replicate + r) · dp_shard + s) · tp + t``
sits at ``(p, r, s, t)``. Every rank along ``pp`` runs its stages of one data-parallel copy:
:class:`Layout`'s replica is ``r · dp_shard + s``, so rank ``q`` runs stage (place) ``q // (dp · tp)`` of
replica ``(q // tp) % dp`` with ``dp = dp_replicate × dp_shard``, as one of the ``tp`` ranks of that
place and copy (:mod:`autosplit.runtime.tensor_parallel`): they run the same micro-batches, each with its
part of the stage's split parameters, and a stage talks to its neighbours at the same ``t`` (the mesh's
``pp`` sub-group). FSDP2 keeps the copies in step on the data-parallel sub-mesh
(:func:`data_parallel_mesh`): ``fully_shard`` over ``dp_shard`` (HSDP, over ``("dp_replicate",
"dp_shard")``, when both are above 1), ``replicate`` over ``dp_replicate``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autosplit.compat import flatten_mesh, fsdp_replicate
from autosplit.errors import DistributedError, advice
from autosplit.passes.chain import Chain
from autosplit.passes.outline import unit_modules
from autosplit.passes.param_dtype import PARAM_CAST
from autosplit.passes.sparse_tables import sparse_gradient_tables
from autosplit.plans import Plan
from autosplit.runtime.experts import expert_modules, expert_parameters

__all__ = [
    "MESH_DIMS", "agree", "data_parallel_mesh", "keep_unread", "Layout", "make_mesh", "place", "rank_device",
    "reduce_sparse_gradients", "replicate_stage",
]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
"""The device mesh's dimensions, outermost first (torchtitan's order)."""


@dataclass(frozen=True)
class Layout:
    """Where this rank sits on the mesh — its place along ``pp`` and its data-parallel copy (``replica``:
    ``r · dp_shard + s`` of the mesh's ``dp_replicate`` and ``dp_shard`` coordinates) — and the stages it runs."""

    stages: int
    replicas: int
    stage: int
    """This rank's place along ``pp`` (with one stage per rank: its stage)."""
    replica: int
    stage_ranks: tuple[int, ...] = ()
    """[stage] its place along ``pp``, when a rank runs several stages (torch's loop or V); empty: stage s at s."""
    tp: int = 1
    """Ranks along ``tp``: each stage of each copy runs on this many ranks, its parameters split among them."""
    tp_rank: int = 0
    """This rank's place along ``tp``."""

    @classmethod
    def of(cls, rank: int, stages: int, replicas: int, stage_ranks: tuple[int, ...] = (), tp: int = 1) -> Layout:
        group = rank // tp
        return cls(stages, replicas, group // replicas, group % replicas, stage_ranks, tp, rank % tp)

    @property
    def pp(self) -> int:
        """Ranks along ``pp``."""
        return max(self.stage_ranks) + 1 if self.stage_ranks else self.stages

    @property
    def held(self) -> tuple[int, ...]:
        """The stages this rank runs, in order."""
        return tuple(s for s in range(self.stages) if self.place(s) == self.stage)

    def place(self, stage: int) -> int:
        """Stage ``stage``'s place along ``pp``."""
        return self.stage_ranks[stage] if self.stage_ranks else stage

    def rank(self, stage: int, replica: int | None = None, tp_rank: int | None = None) -> int:
        """The global rank that runs ``stage`` of ``replica`` at ``tp_rank`` along ``tp`` (default: this rank's)."""
        copy = self.place(stage) * self.replicas + (self.replica if replica is None else replica)
        return copy * self.tp + (self.tp_rank if tp_rank is None else tp_rank)

    def ranks(self, stage: int, replica: int) -> list[int]:
        """Every rank that runs ``stage`` of ``replica``: one per place along ``tp``."""
        return [self.rank(stage, replica, t) for t in range(self.tp)]


def agree(value: Any, what: str, group: Any = None) -> None:
    """Raise :class:`DistributedError` on every rank unless every rank holds the same ``value``."""
    seen: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, value, group=group)
    differ = [r for r, v in enumerate(seen) if v != seen[0]]
    if differ:
        raise DistributedError(
            advice(
                f"ranks disagree on {what}: rank 0 has {seen[0]!r}, ranks {differ} have {[seen[r] for r in differ][:3]!r}",
                "the ranks were given different models, inputs, options or plan files",
                "build the model with the same seed (or load the same checkpoint) and pass the same arguments on every rank",
            )
        )


def place(module: torch.nn.Module, device: torch.device) -> None:
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.device != device:
                t.data = t.data.to(device)


def keep_unread(module: torch.nn.Module, model: torch.nn.Module, chain: Chain) -> None:
    """Register on ``module`` (stage 0's) every entry of the model's ``state_dict`` that no stage
    reads — a parameter or persistent buffer ``forward`` never uses — under a reserved name, so
    stage 0's state dicts, parameters and replication hold it like the stage's own tensors."""
    read = {id(t) for stage in chain.stages for t in [*stage.parameters(), *stage.buffers()]}
    for i, (name, t) in enumerate(model.state_dict(keep_vars=True).items()):
        if not isinstance(t, torch.Tensor) or id(t) in read:
            continue
        read.add(id(t))  # a tied pair of unread names: registered once, found under both
        attr = f"_unread{i}_{name.replace('.', '_')}"
        if isinstance(t, torch.nn.Parameter):
            module.register_parameter(attr, t)
        else:
            module.register_buffer(attr, t)


def rank_device(plan: Plan, stage: int) -> torch.device:
    spec = plan.devices[plan.stage_devices[stage]]
    kind = torch.device(spec.torch_device or "cpu").type
    if kind == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device(kind)


def _quiet_fsdp_view_warning(stage: torch.nn.Module) -> None:
    """Silence FSDP2's "returned a view tensor" warning for this replicated stage module, and only it.

    FSDP2 warns on every forward whose output is a view, because an in-place op on that view
    would drop the pre-backward hook it registers there. A stage's outputs are views when
    ``nn.Linear`` (or a matmul) ends it on a 3-D input: torch computes the product in 2-D and
    returns a 3-D view of it (GPT's qkv projection or head; ``.contiguous()`` keeps such a view as
    it is). The base is a temporary that only the view holds, and the runtime never writes into a
    stage's outputs: a middle stage sends them and runs backward through them, the last stage
    hands them to ``loss_fn``, which reads them (as a loss over an FSDP module's output must).
    The filter matches the message with this stage's class name (``ReplicateStage0``,
    ``FSDPStage1``) from FSDP's own module, so the warning still shows for every other module;
    adding it again replaces the same filter.
    """
    import re
    import warnings

    warnings.filterwarnings(
        "ignore", message=rf"FSDP2-wrapped module \({re.escape(type(stage).__name__)}\) returned a view tensor",
        category=UserWarning, module=r"torch\.distributed\.fsdp\.",
    )


def make_mesh(device: torch.device, degrees: Mapping[str, int], *, ep: int = 1) -> Any:
    """The ``("pp", "dp_replicate", "dp_shard", "tp")`` device mesh of ``degrees`` (a plan's
    :attr:`~autosplit.plans.Plan.mesh`), pp outermost (module docstring); with both data-parallel
    degrees above 1, also their flattened ``"dp"`` (collective: every rank calls it). With the experts
    over ``ep`` of the dp_shard ranks (``1 < ep < dp_shard``), dp_shard is built as ``("efsdp", "ep")``, ep
    inner, and flattened back into ``"dp_shard"``: torchtitan's experts borrow their ranks from the dense
    mesh so, and their state is sharded over ``efsdp`` (:func:`replicate_stage`)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(int(degrees[name]) for name in MESH_DIMS)
    if math.prod(shape) != dist.get_world_size():
        raise DistributedError(advice(
            f"the mesh {dict(zip(MESH_DIMS, shape))} has {math.prod(shape)} ranks, the process group {dist.get_world_size()}",
            "world size = pp × dp_replicate × dp_shard × tp", "launch as many processes as the mesh has ranks",
        ))
    shards = int(degrees["dp_shard"])
    if 1 < ep < shards:
        if shards % ep or degrees["dp_replicate"] > 1:
            raise DistributedError(advice(
                f"expert parallelism over {ep} of dp_shard {shards} × dp_replicate {degrees['dp_replicate']}",
                "the experts' ranks are a factor of dp_shard (efsdp × ep), without dp_replicate",
                f"an ep dividing {shards}, and replicate='fully_shard'",
            ))
        pp, replicas, _, tp = shape
        mesh = init_device_mesh(device.type, (pp, replicas, shards // ep, ep, tp),
                                mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "tp"))
        flatten_mesh(mesh["efsdp", "ep"], "dp_shard")
        return mesh
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
    if degrees["dp_replicate"] > 1 and degrees["dp_shard"] > 1:
        flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
    return mesh


def data_parallel_mesh(mesh: Any) -> Any:
    """The sub-mesh of :func:`make_mesh`'s ``mesh`` that FSDP2 keeps the stages' copies in step on:
    ``("dp_replicate", "dp_shard")`` (HSDP) when both degrees are above 1, else ``"dp_replicate"`` when
    it is, else ``"dp_shard"`` (of one rank without copies: where ``"bf16-fsdp"`` runs FSDP2 alone)."""
    replicas, shards = mesh["dp_replicate"].size(), mesh["dp_shard"].size()
    if replicas > 1 and shards > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_replicate"] if replicas > 1 else mesh["dp_shard"]


def _flat(dp_mesh: Any) -> Any:
    """``dp_mesh`` as one dimension (the ``"dp"`` :func:`make_mesh` flattened, for HSDP's two)."""
    return dp_mesh if dp_mesh.ndim == 1 else flatten_mesh(dp_mesh, "dp")


def replicate_stage(
    module: torch.nn.Module, mode: str, dp_mesh: Any, *, reshard_after_forward: bool = True, precision: str = "fp32",
    experts_mesh: Any = None,
) -> list[torch.nn.Parameter]:
    """Keep ``module``'s replicas in step over ``dp_mesh`` with FSDP2's composable APIs, which the
    pipelining stage drives itself: gradient sync is switched off for all but the last
    micro-batch's backward. ``mode`` is the FSDP2 API's name: ``"replicate"`` (whole parameters,
    gradients all-reduced) or ``"fully_shard"`` (parameters, gradients and optimizer state sharded).
    ``reshard_after_forward`` (``fully_shard`` only): False keeps the stage one FSDP unit whose
    parameters stay gathered from the first forward to the last backward — torchtitan's choice under
    pipelining, where every micro-batch's backward would gather them again: one all-gather per stage
    and step. True (one stage, one micro-batch: FSDP alone) makes each module the graph calls that can be
    a unit of its own (:func:`unit_modules`) one, before the stage's own: its repeated blocks, which the
    runtime outlined as modules at their own paths beforehand
    (:func:`~autosplit.passes.outline.outline_blocks`: torchtitan wraps each block), and its other leaves,
    each gathered for its forward and again for its backward, so only the units at work are whole
    (:mod:`autosplit.passes.sharding` costs both).
    Classic DDP cannot be used here: its reducer is prepared by every forward, but pipelining only
    wraps the backwards in ``no_sync``, and DDP's bucket rebuild then sees each parameter M times.

    FSDP2 reduces dense gradients only: the tables looked up with ``sparse=True``
    (:func:`~autosplit.passes.sparse_tables.sparse_gradient_tables`) are left out of it, whole on every
    replica, and returned; :func:`reduce_sparse_gradients` averages theirs after each step.

    ``precision="bf16-fsdp"`` gives every unit FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)``, inputs left as they come (the model's were cast where they entered, as the
    graph was captured: :mod:`autosplit.passes.param_dtype`). Under ``"bf16-mixed"`` no policy is given:
    autocast's cache already makes one compute copy per step of FSDP2's unsharded parameters, and the
    policy would not train as autocast does (:func:`~autosplit.runtime.precision.cast_once` says why).

    The experts (:mod:`autosplit.runtime.experts`) are left out of the stage's unit: already spread over their ep
    ranks, each one's state lives on one rank where ep is the whole dp_shard, and where it is not (``experts_mesh``,
    the ``efsdp`` ranks that hold the same experts), each experts module is a ``fully_shard`` unit of its own on it,
    first, as torchtitan shards its experts over its ``efsdp`` mesh."""
    tables = sparse_gradient_tables(module)
    if mode not in ("replicate", "fully_shard"):
        raise DistributedError(advice(
            f"replicate={mode!r} names no FSDP2 API",
            "the stages' replicas are kept in step by FSDP2's replicate or fully_shard, under torch's names",
            "pass 'replicate' or 'fully_shard'",
        ))
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cast = PARAM_CAST.get(precision)
    if cast is not None and tables:
        raise DistributedError(advice(
            f"precision={precision!r} with {len(tables)} table(s) looked up with sparse=True",
            "FSDP2 reduces dense gradients only, so those tables are kept apart from it, and its policy would not cast them",
            "look the tables up with sparse=False, or plan with precision='bf16-mixed'",
        ))
    policy = MixedPrecisionPolicy(param_dtype=cast, reduce_dtype=torch.float32 if cast else None, cast_forward_inputs=False)
    apart = [*tables, *expert_parameters(module)]  # spread over their ep ranks already (autosplit.runtime.experts)
    if experts_mesh is not None and mode == "fully_shard":
        for experts in expert_modules(module):
            fully_shard(experts, mesh=experts_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    if mode == "fully_shard":
        for unit in unit_modules(module, apart) if reshard_after_forward else ():  # no write in place into their outputs
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=True, mp_policy=policy)
            _quiet_fsdp_view_warning(unit)
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=set(apart), mp_policy=policy)
    else:
        fsdp_replicate()(module, mesh=dp_mesh, ignored_params=set(apart), mp_policy=policy)
    _quiet_fsdp_view_warning(module)
    return tables


def reduce_sparse_gradients(tables: list[torch.nn.Parameter], dp_mesh: Any) -> None:
    """Average the sparse gradients of ``tables`` over the replicas of ``dp_mesh``, as FSDP2
    averages the dense ones: gloo's sparse all-reduce gathers every replica's rows. A table
    without a gradient this step contributes an empty one, so that every replica joins each call."""
    flat = _flat(dp_mesh)
    group, replicas = flat.get_group(), flat.size()
    for p in tables:
        grad = p.grad if p.grad is not None else torch.sparse_coo_tensor(
            torch.empty(1, 0, dtype=torch.long, device=p.device), p.new_empty(0, *p.shape[1:]), p.shape)
        if not grad.is_sparse:
            raise DistributedError(advice(
                f"the table {tuple(p.shape)} was planned with a sparse gradient and has a dense one",
                "it was replicated apart from FSDP2, which averages dense gradients only",
                "look it up with sparse=True in every forward, or with sparse=False everywhere",
            ))
        grad = grad.coalesce()
        dist.all_reduce(grad, group=group)
        p.grad = grad / replicas

"""``distribute``: plan (or load) a split on rank 0, agree on it across ranks, and build this rank's
:class:`~autosplit.runtime.distributed.DistributedModel`.

Usage (``torchrun --nproc-per-node 2 train.py``)::

    dist.init_process_group("gloo")
    pipe = autosplit.distribute(model, ["cpu"] * 2, example_inputs=(tokens,), loss_fn=loss_fn)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.fx as fx

from autosplit import schedules
from autosplit.api.mesh_checks import check_arguments, check_mesh, degrees, runnable
from autosplit.api.planner import Planner, load_plan
from autosplit.compat import cpu_context_parallel_gaps
from autosplit.compiler.trace import Traced
from autosplit.devices import DeviceLike
from autosplit.errors import AutosplitError, CodegenError, ConstraintError, DistributedError, PlanMismatchError, advice
from autosplit.microbatch import batch_size
from autosplit.passes.capture import flat_inputs
from autosplit.passes.chain import generate_chain, retarget
from autosplit.passes.param_dtype import PARAM_CAST
from autosplit.plans import Plan
from autosplit.runtime.batches import ChainsByRows, keep_only, meta_copy
from autosplit.runtime.compiled import CompileOptions, compile_options
from autosplit.runtime.distributed import DistributedModel
from autosplit.runtime.experts import expert_parallel_stage
from autosplit.runtime.materialise import StageNames, WeightsLike, agree_by_name, materialise
from autosplit.runtime.placement import Layout, agree, data_parallel_mesh, keep_unread, make_mesh, place, rank_device
from autosplit.runtime.precision import stage_device_type
from autosplit.runtime.tensor_parallel import Reductions, check_tp_shards, stage_shards
from autosplit.shapes import is_meta

__all__ = ["distribute"]

log = logging.getLogger(__name__)


def _broadcast_plan(planner: Planner, given: Plan | None, rank: int) -> Plan:
    """Rank 0 plans (or loads) and sends the plan; a failure there is raised on every rank."""
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = ("plan", (given if given is not None else planner.plan()).to_dict())
        except AutosplitError as e:
            box[0] = ("error", e)
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    kind, payload = box[0]
    if kind == "error":
        payload.add_note("(raised on rank 0 while planning, and sent to every rank)")
        raise payload
    return Plan.from_dict(payload, source="the plan broadcast by rank 0")


def distribute(
    model: torch.nn.Module,
    devices: Sequence[DeviceLike] | None,
    *,
    example_inputs: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    example_kwargs: Mapping[str, Any] | None = None,
    data_parallel: int | None = None,
    replicate: Literal["replicate", "fully_shard"] | None = None,
    plan: Plan | str | Path | None = None,
    weights: WeightsLike = None,
    example_target: Any = None,
    compile: bool | CompileOptions = False,
    **options: Any,
) -> DistributedModel:
    """Run ``model`` as pipeline stages across the ranks of the initialised process group.

    ``devices`` are the whole mesh, one per rank in rank order, as :func:`~autosplit.plan` reads them
    (``["cpu"] * 4`` with ``data_parallel=2``: pp 2 × dp 2; ``None`` with a ``plan``): the world size must be
    ``len(devices)`` = pp × data_parallel × tensor_parallel, the ranks of the ``("pp", "dp_replicate",
    "dp_shard", "tp")`` mesh (:attr:`~autosplit.plans.Plan.mesh`, :mod:`autosplit.runtime.placement`);
    a given ``plan`` made for data-parallel copies (``autosplit.plan(model, cluster, ...)`` chooses
    them) runs with the degrees it was made for, which ``data_parallel`` and ``replicate`` default
    to (else 1 and ``"replicate"``); other degrees are refused. A given plan's
    :attr:`~autosplit.plans.Plan.tensor_parallel` runs each stage on that many ranks, its parameters split
    as :attr:`~autosplit.plans.Plan.tp_shards` says (:mod:`autosplit.runtime.tensor_parallel`; a name that
    is no parameter of ``model`` is refused).
    ``example_inputs`` / ``example_kwargs`` are the global batch, as :func:`~autosplit.plan` takes it; every
    :meth:`~DistributedModel.step` takes a data-parallel copy's share, ``1/data_parallel`` of its rows (each
    rank its copy's own rows). ``loss_fn(output, target)`` is called on each micro-batch's output (the model's
    own output structure) and should average over its rows (e.g. ``CrossEntropyLoss()``); with an
    ``example_target`` of the batch, the plan costs it on the stage that returns the output.
    ``replicate``: how each stage's data-parallel replicas keep in step, named as torch names what
    runs — ``"replicate"`` (FSDP2's ``replicate`` over the mesh's ``dp_replicate``: whole parameters on
    every replica, gradients all-reduced) or ``"fully_shard"`` (FSDP2's ``fully_shard`` over its
    ``dp_shard``: parameters, gradients and optimizer state sharded); the former names ``"ddp"`` and
    ``"fsdp"`` are refused, naming these.
    ``options``: any :class:`~autosplit.options.PlanOptions` field (``micro_batches``, ``schedule`` — a flushed
    schedule torch runs, trained by :meth:`~DistributedModel.step`: ``"gpipe"``, ``"1f1b"``, or with
    ``stages_per_rank`` the multi-stage ``"interleaved1f1b"``, ``"loopedbfs"``,
    ``"interleavedzerobubble"``, ``"zbvzerobubble"``, ``"dualpipev"``; or the asynchronous
    ``"xpipe"``, ``"async"``, ``"pipedream"``, trained by :meth:`~DistributedModel.run` —
    ``stages_per_rank``, ``time_limit``, ...; the schedules it runs: the registry's
    ``distributed`` ones, :mod:`autosplit.schedules`).

    A model built on the meta device (``with torch.device("meta"): model = Model(...)``) is planned
    without allocating its weights, and each rank materialises only its stage: ``weights`` is a
    checkpoint read by name (a ``torch.distributed.checkpoint`` folder, a ``torch.save``d state dict,
    a folder of safetensors files), a state dict, or an ``init(stage_module)`` function; by default
    each module's own init (``reset_parameters``, or a transformers model's ``_init_weights``),
    seeded by its name. A real model's stage uses the model's own tensors (with ``precision="bf16"``,
    converted to bfloat16 in place, as ``autosplit.autosplit`` does).

    ``compile=True`` (or a :class:`~autosplit.runtime.compiled.CompileOptions`) compiles each of this
    rank's stage modules with ``torch.compile`` before FSDP2 wraps them (torchtitan's order), or says
    why it cannot (:func:`~autosplit.runtime.compiled.compile_stages`); ``pipe.compiled`` holds each
    stage's status.
    """
    given = load_plan(plan)
    if given is not None:
        check_runnable_layout(given)
    data_parallel, replicate = degrees(given, data_parallel, replicate)
    check_arguments(replicate, data_parallel, None if given is not None else options.get("schedule", "gpipe"))
    shard = check_mesh(given, None if devices is None else len(devices), data_parallel, replicate)
    options = {"schedule": "gpipe", **options, "data_parallel": data_parallel, "replicate": replicate,
               **({"precision": given.precision} if given is not None else {})}  # captured as the plan computes
    planner = Planner(model, devices, example_inputs=example_inputs, example_kwargs=example_kwargs,
                      loss_fn=None if example_target is None else loss_fn, example_target=example_target, **options)
    # each rank builds its copy's share of the batch; one that will not plan captures only that share
    shared = planner.share(data_parallel) if given is not None or dist.get_rank() != 0 else None
    made = dataclasses.replace(_agreed_plan(planner, shared, given, data_parallel), data_parallel=data_parallel, dp_shard=shard)
    check_runnable_layout(made)
    planner = shared if shared is not None else planner.share(data_parallel)
    check_tp_shards(model, made.tp_shards, made.tensor_parallel)
    if made.tensor_parallel > 1:
        _check_tp_attention(planner.traced, rank_device(made, 0).type)
    layout = Layout.of(dist.get_rank(), len(made.stage_devices), data_parallel,
                       stage_ranks=made.stage_devices if made.stages_per_rank > 1 else (), tp=made.tensor_parallel)
    return _build(model, planner, made, given, layout, loss_fn, weights, compile_options(compile))


def _agreed_plan(planner: Planner, shared: Planner | None, given: Plan | None, data_parallel: int) -> Plan:
    """The plan every rank runs: rank 0's (planned by ``planner``, or ``given``), checked on every rank against
    its own capture at a data-parallel copy's share of the batch (``shared``'s, where the rank has one), with the
    same graph and initial weights on every rank."""
    traced = shared.traced if shared is not None else planner.traced.at_batch(data_parallel)
    made = _broadcast_plan(planner, given, dist.get_rank())
    made.check_fingerprint(traced.fingerprint, traced.node_names)
    agree(traced.fingerprint, "the captured graph's fingerprint")
    entry = schedules.lookup(made.schedule) if made.objective == "pipeline" else None
    if entry is None or not entry.distributed:
        runs, on_torch = runnable()
        raise DistributedError(
            advice(
                f"the plan's schedule {made.schedule!r} cannot run pipelined",
                f"torch.distributed.pipelining runs {on_torch}, and autosplit's own loop the asynchronous ones",
                f"re-plan with one of {runs}",
            )
        )
    if entry.asynchronous and (data_parallel != 1 or made.tensor_parallel != 1):
        raise DistributedError(advice(
            f"schedule={entry.name!r} with data_parallel={data_parallel}, tensor_parallel={made.tensor_parallel}",
            "the asynchronous schedules run one replica so far, each stage on one rank",
            "pass data_parallel=1 and a plan with tensor_parallel=1, or schedule='gpipe' / '1f1b'",
        ))
    if entry.asynchronous and any(p.policy == "replicate" for p in made.shared_params):
        raise DistributedError(advice(
            f"schedule={entry.name!r} with tied weights replicated on several stages "
            f"({[p.name for p in made.shared_params if p.policy == 'replicate']})",
            "asynchronous stages update at different times, so replicated copies would drift apart",
            "untie the weights, or train this model with schedule='gpipe' or '1f1b'",
        ))
    if entry.asynchronous and made.precision != "fp32":
        raise DistributedError(advice(
            f"schedule={entry.name!r} with precision={made.precision!r}",
            "the asynchronous schedules run their own loop, which runs fp32 so far",
            "plan with precision='fp32', or train with schedule='gpipe' or '1f1b'",
        ))
    agree(_checksums(planner.model), "the model's initial weights (a checksum per parameter)")
    return made


def _costed_not_run(made: Plan) -> None:
    """Refuse what a plan is costed for and this runtime does not run yet (FP8 linears all-gathered by FSDP2
    under an asynchronous schedule), before any work; say that async TP runs synchronously here."""
    if made.float8_linears and made.dp_shard > 1 and schedules.lookup(made.schedule).asynchronous:
        raise CodegenError(advice(
            f"the plan runs FP8 linears sharded by FSDP2 (dp_shard {made.dp_shard}) under the asynchronous {made.schedule!r} schedule",
            "FP8 weights all-gathered by FSDP2 need their scales recomputed after every optimizer step, which the "
            "asynchronous runtime takes inside its run",
            "plan with a flushed schedule (1f1b, gpipe, …) or replicate='replicate'",
        ))
    if made.ep_overlap and made.expert_parallel > 1:
        log.warning("the plan was costed with the expert all-to-alls overlapped with another micro-batch (ep_overlap=True); this "
                    "runtime runs them in turn, so a step takes longer than the plan's %.4g s (the training is the same)", made.step_time)
    if made.async_tp:
        log.warning("the plan was costed with async tensor parallelism (async_tp=True); this runtime runs the tp collectives "
                    "in turn, so a step takes longer than the plan's %.4g s (the training is the same)", made.step_time)


def _build(
    model: torch.nn.Module, planner: Planner, made: Plan, given: Plan | None, layout: Layout,
    loss_fn: Callable[[Any, Any], torch.Tensor], weights: WeightsLike, compiled: CompileOptions | None,
) -> DistributedModel:
    """This rank's stage of the agreed plan, and nothing else of the model: the chain (at the
    micro-batch's shape) is cut from the model's own capture, keeping only this stage's tensors
    (:func:`~autosplit.runtime.batches.keep_only`), or for a model on the meta device from a copy
    of it; the stage is materialised (:mod:`autosplit.runtime.materialise`), then the device mesh,
    a process group per replicated tied weight, and the runtime around them."""
    if made.objective == "makespan":
        raise DistributedError(advice(
            "a makespan plan (objective='makespan') has no pipeline stages to distribute",
            "its devices hold non-adjacent nodes and run them as their inputs arrive, which no runtime does yet",
            "distribute a plan made with objective='pipeline'",
        ))
    held = layout.held
    device = rank_device(made, held[0])
    _costed_not_run(made)
    tied = [p for p in made.shared_params if p.policy == "replicate"]
    replicated = {p.name for p in tied}
    example = (tuple(planner.example_inputs), dict(planner.example_kwargs or {}))
    chains = ChainsByRows(meta_copy(model), planner.traced.captured, example, made, layout.stages,
                          method=planner.traced.captured.method, replicate=replicated)
    if is_meta(model):
        batch = batch_size(*example)
        chain, captured, meta = chains.to_materialise(batch // made.micro_batches if batch else 0)
    else:  # cut from the model itself, as traced on its device (autocast regions apply there, not on meta)
        captured, flat = planner.traced.at_micro_batch(made.micro_batches)
        own = schedules.lookup(made.schedule).split_backward
        precision = (made.precision, stage_device_type(made))
        chain, meta = generate_chain(captured, made.stage_of, layout.stages, flat, replicate=replicated, own_outputs=own,
                                     precision=precision, recompute=made.recompute, partial=made.recompute_partial,
                                     selective=made.recompute_selective), model
    if given is not None and given.crossings and given.crossings != chain.crossings:
        raise PlanMismatchError(
            advice(
                f"the plan records crossings {given.crossings}, but this model's stages exchange {chain.crossings}",
                "the plan was made for another version of the model or of autosplit",
                "re-plan the model",
            )
        )
    made = dataclasses.replace(made, crossings=chain.crossings)
    if 0 in held:  # (with every stage's tensors in view)
        keep_unread(chain.stages[0], meta, chain)
    chain, captured = (chain, captured) if is_meta(model) else keep_only(chain, captured, held)
    modules = {s: chain.stages[s] for s in held}
    parts = {s: StageNames.of(meta, module) for s, module in modules.items()}
    _untie(modules)
    for s, module in modules.items():
        how = materialise(module, parts[s], device, model=model, weights=weights, seed=planner.options.seed)
        place(module, device)
        retarget(module, device)
        log.info("rank %d: stage %d materialised from %s", dist.get_rank(), s, how)
    names, aliases = (parts[held[0]], {}) if len(held) == 1 else StageNames.merged(parts)
    container = modules[held[0]] if len(held) == 1 else torch.nn.ModuleDict({str(s): m for s, m in modules.items()})
    _equal_copies(container, aliases)
    agree_by_name(container, names)
    the_mesh = make_mesh(device, {**made.mesh, "pp": layout.pp}, ep=made.expert_parallel)
    _spread_experts(modules, model, planner.traced, made, the_mesh, captured, layout.replicas)
    tied_groups = []
    for p in tied:  # new_group is collective: every rank creates every group, in one order
        for replica, t in ((r, t) for r in range(layout.replicas) for t in range(layout.tp)):  # a group per tp place
            ranks = sorted({layout.rank(s, replica, t) for s in p.stages})
            group = dist.new_group(ranks) if len(ranks) > 1 else None  # one rank: its copies are summed locally
            if any(s in held for s in p.stages) and (replica, t) == (layout.replica, layout.tp_rank):
                tied_groups.append((p.name, group))

    def to_flat(args: tuple, kwargs: dict) -> list[Any]:
        return flat_inputs(captured, tuple(args), kwargs)

    entry = schedules.lookup(made.schedule)
    return DistributedModel(
        modules=modules, names=names, aliases=aliases, plan=made, chain=chain, layout=layout, device=device, loss_fn=loss_fn,
        pp_group=the_mesh["pp"].get_group(), dp_mesh=data_parallel_mesh(the_mesh),
        replication="fully_shard" if made.dp_shard > 1 else "replicate", input_names=chain.input_names, to_flat=to_flat,
        micro_batches=made.micro_batches, example=to_flat(*example), chain_at=chains, tied_groups=tied_groups,
        asynchronous=entry.name if entry.asynchronous else None, compiled=compiled, mesh=the_mesh,
        tp_shards={s: stage_shards(made.tp_shards, parts[s].tensors) for s in held},
        reductions=_reductions(planner.traced, made.sequence_parallel) if made.tensor_parallel > 1 else None,
    )


def _spread_experts(
    modules: dict[int, fx.GraphModule], model: torch.nn.Module, traced: Traced, made: Plan, mesh: Any, captured: Any, copies: int,
) -> None:
    """Each MoE layer's experts of this rank's stages spread over the plan's ``ep`` ranks (:mod:`autosplit.runtime.experts`):
    the whole ``dp_shard``, or its ``"ep"`` dimension where ep is a factor of it (:func:`~autosplit.runtime.placement.make_mesh`),
    each expert's gradient then averaged over the ``efsdp`` groups by their FSDP2 unit; nothing for ep 1."""
    if made.expert_parallel <= 1:
        return
    groups = traced.expert_groups(made.precision, stage_device_type(made))
    experts = {g.module: (model.get_submodule(g.module), g.experts) for g in groups}
    whole = made.expert_parallel == made.dp_shard
    ep_mesh, divide = (mesh["dp_shard"], copies) if whole else (mesh["ep"], copies * made.expert_parallel // made.dp_shard)
    for s, module in modules.items():
        spread = expert_parallel_stage(module, experts, captured.module_paths, ep_mesh, divide=divide)
        log.info("rank %d: stage %d spreads the experts of %d layer(s) over ep %d", dist.get_rank(), s, len(spread), made.expert_parallel)


def check_runnable_layout(made: Plan) -> None:
    """Refuse, before any work, what this runtime does not run: context parallelism (costed and exported: torch's
    ``context_parallel`` has no rule for the CPU attention kernels, and autosplit does not run it on GPUs yet); an
    expert-parallel plan other than the experts over ``dp_shard`` or a factor of it (each expert on one rank of its ep
    group, its state sharded over the ``efsdp`` groups), with tp 1 and no dp_replicate, in fp32 or ``bf16-mixed``."""
    if made.context_parallel > 1:
        gaps = cpu_context_parallel_gaps() if stage_device_type(made) == "cpu" else []
        raise ConstraintError(advice(
            f"the plan splits each sequence over cp {made.context_parallel}",
            "autosplit costs and exports context parallelism, and does not run it: "
            + (f"on CPU ranks torch runs neither of its forms ({'; '.join(gaps)})" if gaps else
               "this runtime does not apply torch's context_parallel to its stages yet"),
            "train the plan with torchtitan or Megatron (plan.export), or plan with context_parallel=1",
        ))
    if made.expert_parallel > 1 and (made.tensor_parallel > 1 or made.dp_replicate > 1 or made.dp_shard % made.expert_parallel
                                     or made.precision in PARAM_CAST or made.recompute):
        raise ConstraintError(advice(
            f"expert_parallel={made.expert_parallel} on dp_replicate {made.dp_replicate} × dp_shard {made.dp_shard} × tp "
            f"{made.tensor_parallel}, precision {made.precision!r}, {len(made.recompute)} block(s) recomputed",
            "the runtime spreads the experts over dp_shard or a factor of it, with tp 1 and no dp_replicate, "
            "no block recomputed (FSDP2's bf16 policy would not cast the experts it leaves out; a recomputed block runs the "
            "experts in a module of its own)",
            "plan with an expert_parallel dividing dp_shard, tensor_parallel=1, replicate='fully_shard' and checkpointing='none', "
            "in 'fp32' or 'bf16-mixed', or export the plan to torchtitan or Megatron",
        ))


def _check_tp_attention(traced: Traced, device_type: str) -> None:
    """Refuse, on every rank before any work, a CPU run that splits ``scaled_dot_product_attention``
    over tp: torch 2.13's DTensor has no sharding strategy for its CPU backward
    (``aten._scaled_dot_product_flash_attention_for_cpu_backward``), and its forward returns local
    strides the exported graph's ``reshape`` cannot view."""
    split = sorted(n.name for n in traced.captured.gm.graph.nodes
                   if n.target is torch.ops.aten.scaled_dot_product_attention.default and n.name in traced.tp_rules().split_nodes)
    if split and device_type == "cpu":
        raise ConstraintError(advice(
            f"the plan splits scaled_dot_product_attention over tp on CPU ({len(split)} node(s): {split[:2]})",
            "torch 2.13's DTensor cannot run its CPU backward split (no sharding strategy for "
            "aten._scaled_dot_product_flash_attention_for_cpu_backward)",
            "build the model with its eager attention (transformers: attn_implementation='eager'), or run on CUDA",
        ))


def _reductions(traced: Traced, sequence: bool) -> Reductions:
    """Where the graph's tensor-parallel rules reduce its partial sums (and, under ``sequence`` parallelism,
    turn the activations); sequence parallelism refused where a linear stays whole, as the planner refuses
    it (the plan's costs would not describe the run)."""
    rules = traced.tp_rules()
    if sequence and rules.whole_linears:
        raise ConstraintError(advice(
            f"the plan runs sequence parallelism (sequence_parallel=True), and this graph's tensor-parallel rules leave "
            f"{len(rules.whole_linears)} linear(s) whole: {sorted(rules.whole_linears)[:3]}",
            "sequence parallelism splits the activations between split layers, which every linear must then read split",
            "re-plan with sequence_parallel=False",
        ))
    return Reductions(frozenset(rules.forward_collectives), frozenset(rules.backward_collectives), sequence)


def _untie(modules: Mapping[int, torch.nn.Module]) -> None:
    """A tensor two of this rank's stages hold (a tied weight on both arms of a V) becomes a copy of
    its own in the later stage: each stage is a module of its own to torch's pipelining (its own
    backward and weight passes) and to FSDP2 (which wraps each stage apart and cannot share a
    parameter between two wrapped modules); the copies' gradients are summed after each step."""
    seen: set[int] = set()
    for module in modules.values():
        held = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        copies: dict[int, torch.Tensor] = {}
        for name, t in held:
            if id(t) in seen:
                if id(t) not in copies:
                    fresh = t.detach().clone()
                    copies[id(t)] = torch.nn.Parameter(fresh, t.requires_grad) if isinstance(t, torch.nn.Parameter) else fresh
                owner, _, attr = name.rpartition(".")
                setattr(module.get_submodule(owner), attr, copies[id(t)])
        seen |= {id(t) for _, t in held}


def _equal_copies(container: torch.nn.Module, aliases: Mapping[str, Sequence[str]]) -> None:
    """A tensor two of this rank's stages hold (a tied weight on both arms of a V), materialised
    once per stage: each copy takes the first's value, so they start, and stay, equal."""
    own = {**dict(container.named_parameters(remove_duplicate=False)), **dict(container.named_buffers(remove_duplicate=False))}
    with torch.no_grad():
        for first, copies in aliases.items():
            for name in copies:
                own[name].copy_(own[first])


def _checksums(model: torch.nn.Module) -> list[str]:
    """One number per parameter and buffer (6 significant digits), equal on ranks holding the same weights."""
    with torch.no_grad():
        return [f"{float(t.double().sum()):.6g}" for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta"]

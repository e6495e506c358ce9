"""The two API tiers (DESIGN §3): a :class:`Planner` object, and the one-liners on top of it.

A :class:`Planner` captures and annotates the model once, then plans, builds and answers
"what if" questions (other devices, schedule, memory caps, costs) without capturing again.
:func:`plan` and :func:`autosplit` are thin wrappers; every option is a
:class:`~autosplit.options.PlanOptions` field, passed by keyword.

Usage::

    planner = autosplit.Planner(model, ["cpu"] * 4, example_inputs=(x,), schedule="1f1b")
    plan = planner.plan()
    split = planner.build(plan)
    wider = planner.what_if(devices=["cpu"] * 8, micro_batches=32)

    plan = autosplit.plan(model, ["A100-80GB"] * 8, example_inputs=(x,))      # plan only
    split = autosplit.autosplit(model, ["cpu"] * 4, example_inputs=(x,))      # plan + build
    split = autosplit.autosplit(model, None, example_inputs=(x,), plan="plan.json")
    split = autosplit.autosplit(model, ["cpu"] * 2, example_inputs=(x,), compile=True)  # stages torch.compile'd
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from autosplit import debug
from autosplit.compiler.engine_plans import ENGINE_PREFIXES, engine_recipe, nearest_layer_plan
from autosplit.compiler.hybrid import Cluster
from autosplit.compiler.manual import manual_plan
from autosplit.compiler.mesh import Degrees, degrees_to_try, mesh_plan, stage_ranks
from autosplit.compiler.steps import codegen, compile_plan
from autosplit.compiler.trace import Traced, trace
from autosplit.devices import DeviceLike, DeviceSpec, resolve_devices
from autosplit.errors import ConstraintError, DeviceError, LayerCutError, advice
from autosplit.microbatch import batch_size, split_batch, split_target
from autosplit.options import PlanOptions
from autosplit.passes.loss import Loss
from autosplit.passes.param_dtype import PARAM_CAST, capture_dtype
from autosplit.plan_records import FP8_SHAPES
from autosplit.plans import Plan
from autosplit.recipes import Recipe
from autosplit.runtime.compiled import CompileOptions, compile_options
from autosplit.runtime.local import SplitModule
from autosplit.runtime.makespan import MakespanRunner
from autosplit.shapes import as_tensors, is_meta

__all__ = ["Planner", "plan", "autosplit", "load_plan", "make_options"]


def make_options(options: PlanOptions | None = None, **fields: Any) -> PlanOptions:
    """``options`` (default :class:`PlanOptions`) with ``fields`` set; unknown names are a :class:`ConstraintError`."""
    return (options or PlanOptions()).replace(**fields) if fields else (options or PlanOptions())


def load_plan(plan: Plan | str | Path | None) -> Plan | None:
    return Plan.load(plan) if isinstance(plan, (str, Path)) else plan


class Planner:
    """Plans one model (at one example input shape) onto devices, again and again.

    ``devices``: every rank of the mesh, in rank order — torch device strings or objects (``["cpu"] * 4``
    are four logical devices), presets (``"A100-80GB"``), :class:`DeviceSpec` or a :class:`Cluster`;
    ``None`` only with a saved plan, whose mesh is then used. The world size is ``len(devices)`` =
    pp × data_parallel × tensor_parallel, whatever degrees are given, and the example batch is the global
    one (each data-parallel copy planned on its share). ``options`` and keyword fields: see
    :class:`PlanOptions`. With ``loss_fn(output, target)`` and an ``example_target`` of the
    batch, the plan costs the loss too, on the stage that returns the output.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        devices: Sequence[DeviceLike] | Cluster | None,
        *,
        example_inputs: Any,
        example_kwargs: Mapping[str, Any] | None = None,
        options: PlanOptions | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        example_target: Any = None,
        **fields: Any,
    ) -> None:
        self.model = model
        if isinstance(devices, Cluster):  # the whole mesh: the planner chooses the degrees unless pinned
            fields = {"data_parallel": "auto", "replicate": "auto", **fields}
            devices = devices.replica_devices(devices.size)
        self.loss = _loss(loss_fn, example_target)
        self.example_inputs = as_tensors(example_inputs if isinstance(example_inputs, tuple) else (example_inputs,))
        self.example_kwargs = as_tensors(dict(example_kwargs or {}))
        self.options = make_options(options, **fields)
        self.devices = None if devices is None else tuple(devices)
        # refuses a count the batch does not divide, or (devices known) that the schedule cannot run
        ranks = len(self.devices) if self.devices is not None and not self.options.meshes else None
        self.options.micro_batches_for(ranks, batch_size(self.example_inputs, self.example_kwargs))
        self._traces: dict[Any, Traced] = {}
        """The captured, annotated graphs by the dtype the parameters were captured in (:meth:`traced_for`)."""

    @property
    def traced(self) -> Traced:
        """The captured, annotated graph this planner's options plan on (:meth:`traced_for`)."""
        return self.traced_for(self.options)

    def traced_for(self, options: PlanOptions) -> Traced:
        """The captured, annotated graph ``options`` plan on, made on first use and kept: one capture serves
        every precision, but a graph torch.export made, its dtypes baked in, is captured again for a
        precision that casts the parameters first (:mod:`autosplit.passes.param_dtype`)."""
        wanted = capture_dtype(options.precision)
        if wanted not in self._traces:
            first = next(iter(self._traces.values()), None)
            self._traces[wanted] = first if first is not None and first.captured.method != "export" else trace(
                self.model, self.example_inputs, self.example_kwargs, method=self.options.capture, loss=self.loss,
                precision=options.precision)
        return self._traces[wanted]

    def specs(self, devices: Sequence[DeviceLike] | None = None, options: PlanOptions | None = None) -> tuple[DeviceSpec, ...]:
        devices = self.devices if devices is None else devices
        if devices is None:
            raise DeviceError(advice(
                "devices=None needs a plan to take the devices from",
                "no plan was given",
                "pass devices such as ['cpu'] * 2, or plan=...",
            ))
        return resolve_devices(devices, (options or self.options).memory)

    def plan(self, given: Plan | str | Path | None = None) -> Plan:
        """Solve for the best plan; or, with ``given`` (a :class:`Plan` or a JSON path), check it
        against this model and refresh its predictions without solving."""
        made = dataclasses.replace(self._plan(given), batch=self.traced.batch or 0, parameters=self._parameters())
        if given is None and self.options.expressible_in:  # what keeping to the engine's terms costs: the best plan without it
            free = self._solve(self.specs(), self.options.replace(expressible_in=None))
            made = dataclasses.replace(made, engine_gap=(self.options.expressible_in, free.step_time))
        if debug.plans.isEnabledFor(logging.DEBUG):
            from autosplit.report.text import plan_report  # rich: loaded when the plan is shown

            debug.plans.debug("%s", plan_report(made))
        return made

    def _plan(self, given: Plan | str | Path | None) -> Plan:
        saved = load_plan(given)
        if saved is None:
            return self._solve(self.specs(), self.options)
        # A saved plan fixes the schedule, precision and degrees it was made for (one made for one copy: the
        # options' data_parallel), and (unless devices are given) the devices.
        options = (
            self.options.replace(objective="makespan", precision=saved.precision, **_float8_of(saved)) if saved.objective == "makespan"
            else self.options.replace(schedule=saved.schedule, micro_batches=saved.micro_batches, stages_per_rank=saved.stages_per_rank,
                                      precision=saved.precision, async_tp=saved.async_tp, ep_overlap=saved.ep_overlap,
                                      cp_comm=saved.cp_comm, **_float8_of(saved), **_degrees_of(saved, self.options))
        )
        degrees = Degrees(len(saved.devices), options.replicas, "fully_shard" if options.dp_shard > 1 else "replicate", options.tp,
                          options.ep, options.cp)
        return compile_plan(self.traced_for(options).at_batch(options.replicas), self._stage_devices(saved, degrees, options),
                            options, given=saved)

    def _stage_devices(self, saved: Plan, degrees: Degrees, options: PlanOptions) -> tuple[DeviceSpec, ...]:
        """The device each of a saved plan's stages runs on: the plan's own, or (devices given, the whole mesh)
        the first rank of each stage's group, refusing a count that is not the plan's mesh."""
        if self.devices is None:
            return saved.devices
        specs = self.specs(options=options)
        ranks = degrees.pp * degrees.data_parallel * degrees.tp
        if len(specs) != ranks:
            raise ConstraintError(advice(
                f"the plan runs on pp × data_parallel × tp = {degrees.pp} × {degrees.data_parallel} × {degrees.tp} = {ranks} devices, "
                f"but {len(specs)} devices were given",
                "a saved plan fixes its mesh, and devices are the whole mesh",
                f"pass devices=None to use the plan's devices, or {ranks} devices",
            ))
        return stage_ranks(specs, degrees)

    def build(self, plan: Plan | str | Path | None = None, *, compile: bool | CompileOptions = False) -> SplitModule | MakespanRunner:
        """The :class:`SplitModule` of ``plan`` (default: :meth:`plan`), in this process; for a
        makespan plan, its :class:`~autosplit.runtime.makespan.MakespanRunner`. ``compile``: ``True`` or
        :class:`~autosplit.runtime.compiled.CompileOptions` compiles every stage with ``torch.compile``
        (:func:`~autosplit.runtime.compiled.compile_stages`)."""
        compiling = compile_options(compile)
        made = self.plan() if plan is None else self.plan(plan)
        if is_meta(self.model):
            raise ConstraintError(advice(
                "autosplit() builds every stage in this process from the model's weights, and this model is on the meta device",
                "a model built on meta has no weights until each stage is materialised",
                "plan it with autosplit.plan(...), or train it with autosplit.distribute(..., weights=checkpoint) under torchrun",
            ))
        if made.data_parallel > 1 or made.tensor_parallel > 1:
            raise ConstraintError(advice(
                f"autosplit() builds one pipeline in this process, and the plan's mesh {made.mesh} has "
                f"{made.data_parallel * made.tensor_parallel} ranks per stage",
                "data-parallel copies and tensor-parallel shards run in processes of their own",
                "train it with autosplit.distribute(...) under torchrun, or plan with data_parallel=1 and tensor_parallel=1",
            ))
        if made.precision in PARAM_CAST:
            raise ConstraintError(advice(
                f"autosplit() runs every stage in this process, and precision={made.precision!r} runs in FSDP2's MixedPrecisionPolicy",
                "FSDP2 needs a process group and a device mesh, which one process's SplitModule has not",
                "train it with autosplit.distribute(...) under torchrun (one process is enough), or plan with precision='bf16-mixed'",
            ))
        if made.objective == "makespan":
            if made.precision != "fp32":
                raise ConstraintError(advice(
                    f"a makespan plan (objective='makespan') with precision={made.precision!r}",
                    "the makespan runtime runs the model in its own dtypes so far",
                    "plan with precision='fp32', or with objective='pipeline'",
                ))
            if compiling is not None:
                raise ConstraintError(advice(
                    "compile=True with a makespan plan (objective='makespan')",
                    "the makespan runtime runs each device's nodes as segments of its own, not as stage modules to compile",
                    "pass compile=False, or plan with objective='pipeline'",
                ))
            return MakespanRunner(self.model, self.traced.captured, made)
        program, timings = codegen(self.traced, made)
        made = dataclasses.replace(made, timings={**made.timings, **timings})
        return SplitModule(self.model, self.traced.captured, program, made, compile=compiling)

    def manual(self, split: Any, *, name: str | None = None, check_memory: bool = True, names: Any = None) -> Plan:
        """A split you would write by hand, as a checked plan costed like :meth:`plan`'s: module
        names per stage (torchtitan), ``torch.distributed.pipelining`` split points
        (``{"blocks.4": SplitPoint.BEGINNING}``), a DeepSpeed ``partition_method``
        (``"parameters"``, ``"uniform"``, ``"type:REGEX"``) or a torchgpipe balance (``[3, 2]``);
        see :func:`autosplit.compiler.manual.manual_plan`. A :class:`~autosplit.recipes.Recipe`
        spreads its split over this planner's devices as the whole mesh and the example batch as the
        global one; an engine's configuration — ``"megatron:LAYOUT"`` (or Megatron's flags after the colon),
        ``"torchtitan:FILE.toml"`` or torchtitan's tables as a mapping — is read as such a recipe in the
        model's own module names (``names``: where torchtitan's llama3 modules are, found by itself for a transformers Llama;
        :mod:`autosplit.compiler.engine_plans`). ``check_memory=False`` returns a plan over a cap instead of raising."""
        if (isinstance(split, str) and split.startswith(ENGINE_PREFIXES)) or (isinstance(split, Mapping) and "parallelism" in split) \
                or hasattr(split, "parallelism"):  # torchtitan 0.3's Trainer.Config
            name = name or (split.partition(":")[0] if isinstance(split, str) else "torchtitan")
            tp = self.options.tensor_parallel if isinstance(self.options.tensor_parallel, int) else 1
            split = engine_recipe(split, set(self.traced.captured.module_paths.values()), len(self.specs()),
                                  names=self.options.names if names is None else names, tensor_parallel=tp)
        if isinstance(split, Recipe):
            made = manual_plan(self._copy_of(split), {} if split.split is None else split.split, name=name or "recipe",
                               check_memory=check_memory)
        else:
            if name is None:
                name = (f"deepspeed {split}" if isinstance(split, str) else "split points" if isinstance(split, Mapping)
                        else "balance" if split and all(isinstance(x, int) for x in split) else "manual")
            made = manual_plan(self, split, name=name, check_memory=check_memory)
        return dataclasses.replace(made, batch=self.traced.batch or 0, parameters=self._parameters())

    def _parameters(self) -> tuple[str, ...]:
        """The model's parameters by name, a tied one under each of its names (:attr:`Plan.parameters`)."""
        return tuple(name for name, _ in self.model.named_parameters(remove_duplicate=False))

    def export(self, engine: str, plan: Plan | None = None, *, names: Any = None, form: str = "toml") -> str:
        """``plan`` (default: :meth:`plan`) as ``engine`` reads it (:meth:`autosplit.Plan.export`). Where the plan
        cuts inside a layer, the :class:`~autosplit.errors.LayerCutError` carries the nearest plan that keeps
        layers whole, costed by this planner (``.nearest``), and says its predicted step."""
        made, names = self.plan() if plan is None else plan, self.options.names if names is None else names
        try:
            return made.export(engine, names=names, form=form, model=self.model)
        except LayerCutError as e:
            nearest = nearest_layer_plan(self, made, names)
            error = LayerCutError(advice(
                f"{str(e).split('. Likely cause')[0]}; the nearest plan that keeps every layer whole moves the cut to a layer "
                f"boundary ({' | '.join(', '.join(st.modules) for st in nearest.stages)}): predicted step "
                f"{nearest.step_time:.4g} s against this plan's {made.step_time:.4g} s ({nearest.step_time / made.step_time - 1:+.1%})",
                "torchtitan's module lists and Megatron's layouts place whole layers only",
                "export the nearest plan (this error's .nearest), or plan with expressible_in= the engine for the best one",
            ))
            error.nearest = nearest
            raise error from e

    def _copy_of(self, recipe: Recipe) -> Planner:
        """This planner as one data-parallel copy of ``recipe`` sees the model: the first device of each
        stage's group (as the mesh search lays configurations out), the copy's share of the batch, and
        the recipe's options."""
        specs = self.specs()
        # the devices as resolved (their caps applied): the memory option's indices are the whole mesh's
        layout = self.options.replace(data_parallel=recipe.data_parallel, replicate=recipe.replicate,
                                      tensor_parallel=recipe.tensor_parallel, expert_parallel=recipe.expert_parallel,
                                      context_parallel=recipe.context_parallel, memory=None,
                                      **recipe.options)
        # refuses a degree the devices or batch do not divide, or a tp wider than a node
        (degrees,) = degrees_to_try(len(specs), self.traced.batch, layout, specs[0].island_size, specs[0].name)
        copy_ = copy.copy(self)
        copy_.options = layout
        copy_.devices = stage_ranks(specs, degrees)
        copy_._traces = {capture_dtype(layout.precision): self.traced_for(layout).at_batch(degrees.data_parallel)}
        return copy_

    def share(self, parts: int) -> Planner:
        """This planner as one of ``parts`` data-parallel copies sees the model: the copy's share of the example
        batch and its capture (:meth:`~autosplit.compiler.trace.Traced.at_batch`); ``parts = 1``: itself. A planner
        that has captured nothing yet captures the share alone, when first asked: a rank that runs a plan it did not
        make never captures the whole batch (the same graph: a traced one runs any batch, and an exported one is
        captured again at the share's rows by ``at_batch`` too)."""
        if parts == 1:
            return self
        copy_ = copy.copy(self)
        if not self._traces:
            args, kwargs = split_batch(self.example_inputs, self.example_kwargs, parts)[0]
            copy_.example_inputs, copy_.example_kwargs, copy_._traces = tuple(args), dict(kwargs), {}
            copy_.loss = None if self.loss is None else Loss(self.loss.fn, split_target(self.loss.target, parts)[0])
            return copy_
        traced = self.traced.at_batch(parts)
        copy_.example_inputs, copy_.example_kwargs = tuple(traced.example[0]), dict(traced.example[1])
        copy_._traces = {capture_dtype(self.options.precision): traced}
        return copy_

    def with_options(self, **changes: Any) -> Planner:
        """A planner of the same model and capture under other options (captured again only for a precision
        an exported graph was not captured for: :meth:`traced_for`)."""
        other = copy.copy(self)
        other.options = self.options.replace(**changes)
        return other

    def what_if(self, *, devices: Sequence[DeviceLike] | None = None, **changes: Any) -> Plan:
        """The plan under other devices or options, reusing the captured graph:
        ``planner.what_if(devices=["cpu"] * 8, schedule="1f1b")``."""
        options = self.options.replace(**changes)
        return self._solve(self.specs(devices, options), options)

    def _solve(self, specs: tuple[DeviceSpec, ...], options: PlanOptions) -> Plan:
        """One plan of ``specs``; over the whole mesh, the data-parallel degrees chosen with it."""
        traced = self.traced_for(options)
        return mesh_plan(traced, specs, options) if options.meshes else compile_plan(traced, specs, options)


def _loss(loss_fn: Callable[[Any, Any], torch.Tensor] | None, example_target: Any) -> Loss | None:
    if (loss_fn is None) != (example_target is None):
        given, missing = ("loss_fn", "example_target") if example_target is None else ("example_target", "loss_fn")
        raise ConstraintError(advice(
            f"{given} was given without {missing}",
            "the planner costs the loss by running loss_fn(output, target) on the model's output and one micro-batch of the target",
            f"pass {missing} too, or neither (the loss is then not costed)",
        ))
    return None if loss_fn is None else Loss(loss_fn, as_tensors(example_target))


def plan(
    model: torch.nn.Module, devices: Sequence[DeviceLike] | Cluster, *, example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None = None, **options: Any,
) -> Plan:
    """Plan ``model`` onto ``devices`` without building modules (devices may be hardware you lack).

    ``options``: any :class:`PlanOptions` field — ``micro_batches``, ``schedule``, ``precision``,
    ``checkpointing``, ``recompute``, ``optimizer``, ``memory``, ``time_limit``, ``seed``, ``capture``,
    ``costs``, ``cost_overrides``, ``pin``, ``avoid``, ``together``; or ``loss_fn`` and ``example_target``
    (see :class:`Planner`). A set of constraints that cannot hold is explained in the
    user's terms (:class:`~autosplit.errors.InfeasiblePlanError`). ``devices`` are the whole mesh (a list
    or a :class:`~autosplit.Cluster`) and the example batch the global one: ``plan(model, ["cpu"] * 4,
    data_parallel=2)`` plans pp 2 × dp 2, each copy on half the batch. A Cluster, ``data_parallel="auto"`` or
    ``replicate="auto"`` has the degrees chosen with the split (:mod:`autosplit.compiler.mesh`).
    """
    return Planner(model, devices, example_inputs=example_inputs, example_kwargs=example_kwargs, **options).plan()


def autosplit(
    model: torch.nn.Module, devices: Sequence[DeviceLike] | None, *, example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None = None, plan: Plan | str | Path | None = None,
    compile: bool | CompileOptions = False, **options: Any,
) -> SplitModule | MakespanRunner:
    """Partition ``model`` over ``devices`` and return a module that trains exactly like it.

    The returned :class:`SplitModule` shares ``model``'s parameters (moved to their
    devices in place; with ``precision="bf16"`` also converted to bfloat16 in place, as
    ``model.to(torch.bfloat16)`` would) and carries the plan as ``.plan``. Pass ``plan`` (a :class:`Plan`
    or a JSON path) to rebuild a saved split without solving; ``devices=None`` then
    takes the plan's devices. ``compile=True`` (or a :class:`~autosplit.runtime.compiled.CompileOptions`)
    compiles each stage with ``torch.compile`` in place; where that cannot run, a
    :class:`~autosplit.errors.CompileError` says why (or, with ``CompileOptions(fallback=True)``, a logged warning and
    an eager stage). ``options``: see :func:`plan`.
    """
    planner = Planner(model, devices, example_inputs=example_inputs, example_kwargs=example_kwargs, **options)
    return planner.build(plan, compile=compile)


def _degrees_of(saved: Plan, options: PlanOptions) -> dict[str, Any]:
    """A saved plan's degrees as options: its own where it was made for data-parallel copies, else one copy
    run under the options' ``data_parallel`` and ``replicate``; its tensor parallelism either way."""
    if saved.data_parallel > 1:
        return {"data_parallel": saved.data_parallel, "replicate": "fully_shard" if saved.dp_shard > 1 else "replicate",
                "tensor_parallel": saved.tensor_parallel, "expert_parallel": saved.expert_parallel,
                "context_parallel": saved.context_parallel}
    return {"data_parallel": options.replicas, "replicate": "replicate" if options.replicate == "auto" else options.replicate,
            "tensor_parallel": saved.tensor_parallel, "expert_parallel": saved.expert_parallel, "context_parallel": saved.context_parallel}


def _float8_of(saved: Plan) -> dict[str, Any]:
    """The options that convert a saved plan's FP8 linears again: its recipe, each linear it kept in bf16 but
    for its shape filtered by name (an ``"auto"`` plan's cost decisions, the output layer); recost checks the
    result is the plan's (:func:`~autosplit.compiler.recost.recost`)."""
    if saved.float8 is None:
        return {"float8": None}
    return {"float8": saved.float8, "float8_exclude": tuple(p for p, why in saved.float8_kept if FP8_SHAPES not in why)}


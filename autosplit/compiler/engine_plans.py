"""The engines' configurations read back as recipes: a Megatron-LM layout (or its flags) and a torchtitan job config.

:func:`engine_recipe` turns ``"megatron:LAYOUT"``, ``"megatron:--flag value …"`` (the flags
:meth:`~autosplit.plans.Plan.export` writes), ``"torchtitan:FILE.toml"`` or a torchtitan config
mapping into a :class:`~autosplit.recipes.Recipe` over the planner's whole mesh, in the model's own
module names (:class:`~autosplit.plan_export.Names`), so that :meth:`autosplit.Planner.manual`
costs it, :func:`autosplit.compare` sets it beside autosplit's plan and :func:`autosplit.distribute`
runs it. What autosplit's runtime cannot run the way the engine would (torchtitan's per-op
selective checkpointing, HSDP in one recipe) is refused by name, not approximated.

Usage::

    plan = planner.manual("megatron:Et*2|(t*2|)*34,t*3|(t*2|)*3,tL")
    plan = planner.manual("torchtitan:llama3_70b.toml")
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shlex
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib

from autosplit import schedules
from autosplit.errors import ConstraintError, advice
from autosplit.megatron_layout import check, parse
from autosplit.plan_export import OUTPUT_NAME, Names, layer_paths, module_prefixes, names_for, torchtitan_precision
from autosplit.plans import Plan
from autosplit.recipes import Recipe

__all__ = ["ENGINE_PREFIXES", "engine_recipe", "megatron_recipe", "nearest_layer_plan", "torchtitan_recipe"]

ENGINE_PREFIXES = ("megatron:", "torchtitan:")
log = logging.getLogger(__name__)

_SCHEDULE_OF = {entry.torch_class.removeprefix("Schedule").lower(): name for name, entry in schedules.REGISTRY.items()
                if entry.torch_class}
"""torchtitan's schedule names (torch's classes, read as torch reads them: any case) → autosplit's."""


def engine_recipe(text: Any, paths: Collection[str], world: int, *, names: Names | Mapping[str, str] | None = None,
                  tensor_parallel: int = 1) -> Recipe:
    """The recipe of an engine's configuration over ``world`` devices of a model with module ``paths``
    (its nodes' paths: every level of them counts); ``tensor_parallel``: the tp a bare Megatron layout runs at.
    ``text``: ``"megatron:…"``, ``"torchtitan:FILE.toml"``, torchtitan 0.2's tables as a mapping, or a
    torchtitan 0.3 ``Trainer.Config``."""
    prefixes = module_prefixes(paths)
    resolved = names_for(prefixes, names)
    layers = len(layer_paths(prefixes, resolved))
    if not isinstance(text, str):
        return torchtitan_recipe(text, resolved, world, layers)
    engine, _, body = text.partition(":")
    if engine == "megatron":
        return megatron_recipe(body, resolved, world, layers, tensor_parallel)
    if engine == "torchtitan":
        try:
            config = tomllib.loads(Path(body).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConstraintError(advice(f"cannot read torchtitan config {body!r}: {e}", "the file is missing or not TOML",
                                         "pass torchtitan:PATH to a v0.2 job config, or the config as a mapping")) from e
        return torchtitan_recipe(config, resolved, world, layers)
    raise ConstraintError(advice(f"no engine {engine!r} in {text[:40]!r}", "autosplit reads Megatron-LM and torchtitan configurations",
                                 f"start it with one of {ENGINE_PREFIXES}"))


def _stage_modules(titan: Sequence[Sequence[str]], names: Names) -> list[list[str]]:
    """torchtitan's names per stage (``output`` or ``lm_head``) as the model's."""
    return [[names.model_path("output" if f in OUTPUT_NAME.values() else f) for f in stage] for stage in titan]


def megatron_recipe(body: str, names: Names, world: int, num_layers: int, tensor_parallel: int = 1) -> Recipe:
    """A Megatron layout with the flags around it, or alone: then at ``tensor_parallel``, on as many
    pipeline ranks as both its stages and the devices over tp allow (the greatest common divisor; 40
    stages on 64 devices at tp 4 are pp 8 × vp 5, data-parallel 2: Megatron-Bridge's Llama-3-70B), the
    rest of the devices data-parallel. Checked as Megatron checks it against the model's ``num_layers``."""
    flags = _megatron_flags(body) if body.lstrip().startswith("--") else {"pipeline-model-parallel-layout": body}
    layout = flags.get("pipeline-model-parallel-layout")
    if layout is None:
        raise ConstraintError(advice("the Megatron flags give no --pipeline-model-parallel-layout",
                                     "autosplit reads a Megatron split from its layout", "add the layout"))
    stages = parse(layout)
    tp, (cp, cp_comm) = int(flags.get("tensor-model-parallel-size", tensor_parallel)), _megatron_context(flags)
    pp = int(flags.get("pipeline-model-parallel-size", math.gcd(len(stages), max(1, world // (tp * cp)))))
    vp = check(stages, num_layers=num_layers, pipeline=pp)
    if "m" in "".join("".join(s) for s in stages):
        raise ConstraintError(advice(f"layout {layout!r} holds multi-token prediction layers m", "the model has none",
                                     "write the layout of this model's layers"))
    if world % (tp * pp * cp):
        raise ConstraintError(advice(f"tp {tp} × pp {pp} × cp {cp} does not divide the {world} devices", "Megatron's data-parallel "
                                     "size is the devices over tp × pp × cp", "give sizes whose product divides the devices"))
    titan, layer = [], 0
    for stage in stages:
        part = ["tok_embeddings"] if "E" in stage else []
        part += [f"layers.{i}" for i in range(layer, layer + stage.count("t"))]
        layer += stage.count("t")
        titan.append(part + (["norm", "output"] if "L" in stage else []))
    dp = world // (tp * pp * cp)
    schedule = "gpipe" if len(stages) == 1 else "interleaved1f1b" if vp > 1 else "1f1b"  # one stage: no pipeline to schedule
    options: dict[str, Any] = {"schedule": schedule, "stages_per_rank": vp, "checkpointing": "none",
                               **({"cp_comm": cp_comm} if cp > 1 else {})}
    if "micro-batch-size" in flags and "global-batch-size" in flags:  # Megatron's micro-batches per step and copy
        options["micro_batches"] = int(flags["global-batch-size"]) // (int(flags["micro-batch-size"]) * dp)
    if "recompute-granularity" in flags:
        options.update(_megatron_checkpointing(flags, titan, names))
    if "sequence-parallel" in flags:
        options["sequence_parallel"] = True
    if "tp-comm-overlap" in flags and tp > 1:
        options["async_tp"] = True
    if "fp8-format" in flags:
        options["float8"] = _megatron_float8(flags)
    ep = _expert_degree(int(flags.get("expert-model-parallel-size", 1)), int(flags.get("expert-tensor-parallel-size", 1)), "Megatron")
    if "overlap-moe-expert-parallel-comm" in flags and ep > 1:
        options["ep_overlap"] = True
    return Recipe(split=_stage_modules(titan, names), data_parallel=dp, tensor_parallel=tp, expert_parallel=ep, context_parallel=cp,
                  options=options,
                  replicate=_megatron_replicate(flags, pipelined=len(stages) > 1))


def _megatron_context(flags: Mapping[str, str]) -> tuple[int, str]:
    """The context-parallel degree of Megatron's flags and its exchange: ``--cp-comm-type p2p`` (Megatron's default, the
    keys and values round a ring) or ``a2a`` (all-to-all over heads), the two autosplit costs
    (:mod:`autosplit.passes.cp_costs`); another (``allgather``, the hierarchical ``a2a+p2p``) is refused by name."""
    cp, form = int(flags.get("context-parallel-size", 1)), flags.get("cp-comm-type", "p2p")
    if cp > 1 and form not in ("p2p", "a2a"):
        raise ConstraintError(advice(
            f"the Megatron flags exchange each sequence's shards over cp {cp} by --cp-comm-type {form}",
            "autosplit costs context parallelism as the p2p ring of keys and values (Megatron's default) or its all-to-all "
            "over heads (a2a), and would cost this run as another one",
            "read it with --cp-comm-type p2p or a2a, knowing the exchange differs",
        ))
    return cp, form


def _megatron_replicate(flags: Mapping[str, str], pipelined: bool) -> str:
    """FSDP2's name for Megatron's data parallelism: Megatron-FSDP sharding parameters, gradients and optimizer
    state is ``fully_shard``; plain data parallelism ``replicate``. Megatron's distributed optimizer shards the
    optimizer state and the fp32 master weights; it all-gathers the parameters and reduce-scatters the
    gradients once per step, holding both whole in between. Under a pipeline that is what FSDP2's
    ``fully_shard`` does with each stage (one unit, gathered for the step, its gradients accumulated whole
    and reduce-scattered after the last micro-batch: :mod:`autosplit.passes.sharding`), holding 4/D bytes per
    parameter more (the sharded gradient beside the whole one): ``fully_shard``. Without a pipeline FSDP2
    gathers block by block, which holds less than Megatron: it is costed as ``replicate``, holding that state
    whole (more memory than Megatron needs, never less), and said so in the log."""
    if "use-megatron-fsdp" in flags:
        strategy = flags.get("data-parallel-sharding-strategy", "")
        if strategy != "optim_grads_params":
            raise ConstraintError(advice(
                f"Megatron-FSDP with --data-parallel-sharding-strategy {strategy or '(its default)'}",
                "FSDP2 shards parameters, gradients and optimizer state together (Megatron's optim_grads_params)",
                "give --data-parallel-sharding-strategy optim_grads_params",
            ))
        return "fully_shard"
    if "use-distributed-optimizer" in flags and pipelined:
        return "fully_shard"
    if "use-distributed-optimizer" in flags:
        log.warning("Megatron's distributed optimizer shards only the optimizer state; the recipe is costed with it whole "
                    "(replicate): its memory is an upper bound")
    return "replicate"


_MEGATRON_FP8 = {"delayed": "tensorwise", "tensorwise": "tensorwise", "mxfp8": "mxfp8"}
"""Megatron's ``--fp8-recipe`` as :attr:`~autosplit.options.PlanOptions.float8` costs it: a scale per tensor, delayed
(its default) or current, or MXFP8's per 32 values."""


def _megatron_float8(flags: Mapping[str, str]) -> str:
    """The FP8 recipe of ``--fp8-format`` (``e4m3``, ``hybrid``) with ``--fp8-recipe``; blockwise is not costed."""
    recipe = flags.get("fp8-recipe", "delayed")
    if recipe not in _MEGATRON_FP8:
        raise ConstraintError(advice(f"--fp8-recipe {recipe} is not costed", f"autosplit costs the FP8 recipes {', '.join(_MEGATRON_FP8)}",
                                     "cost the recipe in bf16 (drop --fp8-format) or with --fp8-recipe tensorwise"))
    return _MEGATRON_FP8[recipe]


def _megatron_flags(body: str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        words = shlex.split(body.replace("\\\n", " "), comments=True)  # the notes export writes are comments
    except ValueError as e:  # an unclosed quote
        raise ConstraintError(advice(f"the Megatron flags {body[:60]!r}… do not split as a shell would: {e}",
                                     "they are read as a command line", "close the quotes")) from e
    for k, word in enumerate(words):
        if word.startswith("--"):
            value = words[k + 1] if k + 1 < len(words) and not words[k + 1].startswith("--") else ""
            out[word[2:]] = value
    return out


def _megatron_checkpointing(flags: Mapping[str, str], titan: Sequence[Sequence[str]], names: Names) -> dict[str, Any]:
    """Megatron's full recomputation as autosplit's options: every layer (``uniform`` 1), or each stage's first N (``block`` N)."""
    method, n = flags.get("recompute-method", "uniform"), int(flags.get("recompute-num-layers", 1) or 1)
    if flags.get("recompute-granularity") != "full" or method not in ("uniform", "block") or (method == "uniform" and n != 1):
        raise ConstraintError(advice(
            f"Megatron recompute {dict(flags)}", "autosplit recomputes whole layers: Megatron's full granularity, uniform over "
            "single layers or block over each stage's first layers", "use --recompute-granularity full with uniform 1 or block N",
        ))
    if method == "uniform":
        return {"checkpointing": "full"}
    first = [p for stage in titan for p in [q for q in stage if q.startswith("layers.")][:n]]
    return {"checkpointing": "none", "recompute": {names.model_path(p): True for p in first}}


def torchtitan_tables(config: Any) -> tuple[dict[str, dict[str, Any]], str]:
    """The ``parallelism``, ``activation_checkpoint`` and ``training`` fields of a torchtitan config, and the
    release whose meaning they have: a ``Trainer.Config`` object is 0.3's (its checkpointing a config class:
    ``FullAC`` is ``"full"``, ``None`` ``"none"``); a mapping of tables, or a TOML file's, is the 0.2 job
    config's. A field no release has, or 0.3's output name in a 0.2 config, is refused by name."""
    if isinstance(config, Mapping):
        tables, release = {k: dict(config.get(k) or {}) for k in ("parallelism", "activation_checkpoint", "training")}, "0.2"
    elif hasattr(config, "parallelism") and hasattr(config, "training"):
        ac = getattr(config, "activation_checkpoint", None)
        kind = type(ac).__qualname__.split(".")[0] if ac is not None else "none"
        mode = {"none": "none", "FullAC": "full", "SelectiveAC": "selective"}.get(kind, kind)
        tables = {k: {f.name: getattr(getattr(config, k), f.name) for f in dataclasses.fields(getattr(config, k))}
                  for k in ("parallelism", "training")}
        tables, release = {**tables, "activation_checkpoint": {"mode": mode}}, "0.3"
    else:
        raise ConstraintError(advice(f"a torchtitan config of type {type(config).__name__}", "autosplit reads torchtitan 0.3's "
                                     "Trainer.Config, or 0.2's job config as TOML or a mapping of its tables", "pass one of those"))
    if "num_pp_microbatches" in tables["parallelism"]:
        raise ConstraintError(advice(
            "the torchtitan config sets parallelism.num_pp_microbatches, which no torchtitan release has",
            "torchtitan 0.2 and 0.3 take the micro-batches as training.local_batch_size // "
            "parallelism.pipeline_parallel_microbatch_size (0.3 raises AttributeError on the field)",
            "set pipeline_parallel_microbatch_size instead, or export the plan again: plan.export('torchtitan', form='python')",
        ))
    other = OUTPUT_NAME["0.3" if release == "0.2" else "0.2"]
    if any(other in stage for stage in tables["parallelism"].get("module_fqns_per_model_part") or ()):
        raise ConstraintError(advice(
            f"the torchtitan {release} config lists {other!r}, torchtitan "
            f"{'0.3' if release == '0.2' else '0.2'}'s name for the output layer",
            f"torchtitan {release}'s llama3 names it {OUTPUT_NAME[release]!r} and drops every module its lists do not name: "
            "it would train without its output layer", f"list {OUTPUT_NAME[release]!r}" + (
                ", or pass torchtitan 0.3's Trainer.Config itself" if release == "0.2" else ""),
        ))
    return tables, release


def torchtitan_recipe(config: Any, names: Names, world: int, num_layers: int) -> Recipe:
    """A torchtitan config over ``world`` devices of a model of ``num_layers`` layers, read as its release
    means it (:func:`torchtitan_tables`); a shard degree of -1 is torchtitan's "the devices left over".
    Module lists that leave out a module are refused: torchtitan's split would drop it."""
    tables, release = torchtitan_tables(config)
    par, ac, training = tables["parallelism"], tables["activation_checkpoint"], tables["training"]
    replicate, shard = int(par.get("data_parallel_replicate_degree", 1)), int(par.get("data_parallel_shard_degree", -1))
    cp = int(par.get("context_parallel_degree", 1))
    if shard == -1:
        shard = world // (replicate * cp * int(par.get("tensor_parallel_degree", 1)) * int(par.get("pipeline_parallel_degree", 1)))
    if replicate > 1 and shard > 1:
        raise ConstraintError(advice(
            f"torchtitan config replicates over {replicate} and shards over {shard} (HSDP)",
            "a recipe holds one data-parallel layout", "read it with one of the two, or let autosplit plan the mesh",
        ))
    fqns = par.get("module_fqns_per_model_part")
    pp = int(par.get("pipeline_parallel_degree", 1))
    if (pp > 1 and not fqns) or (fqns and len(fqns) % pp):
        raise ConstraintError(advice(
            f"the torchtitan config has pipeline degree {pp} and {len(fqns or [])} module lists",
            "autosplit reads torchtitan's stages from module_fqns_per_model_part, the same number per pipeline rank",
            "give a list per stage, a multiple of the pipeline degree",
        ))
    listed = {"output" if f == OUTPUT_NAME[release] else f for stage in fqns or () for f in stage}
    missing = sorted({"tok_embeddings", "norm", "output", *(f"layers.{i}" for i in range(num_layers))} - listed) if fqns else []
    if missing:
        raise ConstraintError(advice(
            f"the torchtitan config's module_fqns_per_model_part leaves out {missing[:6]}",
            "torchtitan keeps only the modules its lists name: those would not be trained", "list every module once",
        ))
    schedule = str(par.get("pipeline_parallel_schedule", "1F1B")).lower()
    if schedule not in _SCHEDULE_OF:
        raise ConstraintError(advice(f"torchtitan schedule {schedule!r}", "autosplit runs torch's schedules",
                                     f"use one of {sorted(_SCHEDULE_OF)}"))
    options: dict[str, Any] = {"schedule": _SCHEDULE_OF[schedule] if pp > 1 else "gpipe",
                               "stages_per_rank": len(fqns) // pp if fqns else 1}
    mode = (ac.get("mode") or "none") if ac else "none"
    if mode not in ("none", "full"):
        raise ConstraintError(advice(
            f"torchtitan activation_checkpoint mode {mode!r}", "autosplit recomputes whole layers (or chooses which)",
            "use mode 'full' or 'none', or plan with checkpointing='auto'",
        ))
    options["checkpointing"] = mode
    if pp > 1 and "local_batch_size" in training and "pipeline_parallel_microbatch_size" in par:
        options["micro_batches"] = int(training["local_batch_size"]) // int(par["pipeline_parallel_microbatch_size"])
    elif pp == 1 and "local_batch_size" in training and int(training.get("global_batch_size", -1)) > 0:  # gradient accumulation
        options["micro_batches"] = int(training["global_batch_size"]) // (int(training["local_batch_size"]) * max(replicate, shard))
    tp = int(par.get("tensor_parallel_degree", 1))
    if tp > 1:
        options["sequence_parallel"] = bool(par.get("enable_sequence_parallel", True))
        options["async_tp"] = bool(par.get("enable_async_tensor_parallel", False))
    options["precision"] = torchtitan_precision(str(training.get("mixed_precision_param", "bfloat16")), sharded=shard > 1,
                                                split=tp > 1 or pp > 1, release=release)
    options |= torchtitan_float8(config, names, release)
    ep = _expert_degree(int(par.get("expert_parallel_degree", 1)), int(par.get("expert_tensor_parallel_degree", 1)), "torchtitan")
    return Recipe(split=_stage_modules(fqns, names) if fqns else None, data_parallel=max(replicate, shard), tensor_parallel=tp,
                  replicate="fully_shard" if shard > 1 else "replicate", expert_parallel=ep, context_parallel=cp, options=options)


def _expert_degree(ep: int, etp: int, engine: str) -> int:
    """An engine's expert-parallel degree, its experts whole on each of their ranks (expert tensor parallelism 1: what
    autosplit costs, :mod:`autosplit.passes.ep_costs`); a split of the experts themselves is refused."""
    if etp != 1:
        raise ConstraintError(advice(
            f"the {engine} configuration splits each expert over {etp} ranks (expert tensor parallelism)",
            "autosplit lays each expert whole on its ranks, borrowed from dp_shard × tp (torchtitan's and Megatron's etp 1)",
            "set the expert tensor-parallel degree to 1",
        ))
    return ep


def torchtitan_float8(config: Any, names: Names, release: str) -> dict[str, Any]:
    """The ``float8`` and ``float8_exclude`` options of a torchtitan config's float8 linear converter (none
    without one): 0.2's ``model.converters = ["quantize.linear.float8"]`` with its table, or the
    ``Float8Linear`` configs a 0.3 model config holds after ``Float8LinearConverter`` (its recipe read from
    their torchao config). torchtitan converts every linear of FP8's shapes its filters do not name: the
    options convert those (a recipe, not ``"auto"``); a filter other than the output layer is refused by name."""
    if release == "0.3":
        return _titan_converted(config, names)
    model = config.get("model") or {}
    converters = list(model.get("converters") or [])
    if not converters:
        return {}
    if converters != ["quantize.linear.float8"]:
        raise ConstraintError(advice(f"torchtitan model.converters {converters}", "autosplit reads torchtitan 0.2's float8 "
                                     "linear converter, 'quantize.linear.float8'", "convert with that one alone, or none"))
    table = ((config.get("quantize") or {}).get("linear") or {}).get("float8") or {}
    filters = list(table.get("filter_fqns") or [])
    if any(f != OUTPUT_NAME[release] for f in filters):
        raise ConstraintError(advice(
            f"torchtitan float8 filter_fqns {filters}", "autosplit reads torchtitan's filter of the output layer "
            f"({OUTPUT_NAME[release]!r}); other filters name torchtitan's modules, not the model's",
            f"filter {OUTPUT_NAME[release]!r} alone, or plan with float8_exclude= in the model's module names"))
    return {"float8": table.get("recipe_name") or "tensorwise",
            "float8_exclude": (names.model_path("output"),) if filters else ()}


def _titan_converted(config: Any, names: Names) -> dict[str, Any]:
    """0.3: the recipe and the output's filter from the ``Float8Linear`` configs in ``config.model_spec.model``."""
    spec = getattr(config, "model_spec", None)
    if spec is None or not hasattr(spec, "traverse"):
        return {}
    from torchao.float8 import Float8LinearConfig  # torchtitan 0.3 builds these configs with it
    from torchtitan.models.common.linear import Linear  # the config given is torchtitan's: it is installed

    linears = [(fqn.removeprefix("model."), cfg) for fqn, cfg, _, _ in spec.traverse(Linear.Config)]
    converted = {fqn: getattr(cfg, "_torchao_config", None) for fqn, cfg in linears if type(cfg).__qualname__.startswith("Float8Linear")}
    if not converted:
        return {}
    recipes = {name for name in ("rowwise", "rowwise_with_gw_hp") for c in converted.values()
               if c == Float8LinearConfig.from_recipe_name(name)}
    skipped = [fqn for fqn, cfg in linears if fqn not in converted and fqn != OUTPUT_NAME["0.3"]
               and cfg.in_features % 16 == 0 and cfg.out_features % 16 == 0]
    if recipes != {"rowwise"} or skipped:
        raise ConstraintError(advice(
            f"the torchtitan 0.3 model converts {len(converted)} linears to Float8Linear with recipes {sorted(recipes) or 'unknown'}"
            + (f" and leaves {skipped[:3]} in bf16" if skipped else ""),
            "autosplit reads rowwise float8 on every linear of FP8's shapes but the output layer", "convert them so, or plan the recipe"))
    return {"float8": "rowwise", "float8_exclude": () if OUTPUT_NAME["0.3"] in converted else (names.model_path("output"),)}


def nearest_layer_plan(planner: Any, plan: Plan, names: Names | Mapping[str, str] | None = None) -> Plan:
    """The plan nearest ``plan`` that keeps every module an engine places whole (the embedding, each
    layer, the final norm, the output): each goes to the stage that runs most of its nodes (never before
    the module ahead of it), costed by ``planner`` as a recipe of the same mesh, schedule and micro-batches."""
    paths = planner.traced.captured.module_paths
    prefixes = module_prefixes(paths.values())
    resolved = names_for(prefixes, names)
    units = [resolved.tok_embeddings, *layer_paths(prefixes, resolved), resolved.norm, resolved.output]
    stage_of, floor = plan.stage_of, 0
    lists: list[list[str]] = [[] for _ in plan.stages]
    for unit in units:
        counts: dict[int, int] = {}
        for node, path in paths.items():
            if node in stage_of and (path == unit or path.startswith(unit + ".")):
                counts[stage_of[node]] = counts.get(stage_of[node], 0) + 1
        if counts:  # a module the graph never runs (none here for a Llama) has no stage to keep
            floor = max(floor, max(counts, key=lambda s: (counts[s], -s)))
            lists[floor].append(unit)
    recipe = Recipe(split=lists, data_parallel=plan.data_parallel, tensor_parallel=plan.tensor_parallel,
                    expert_parallel=plan.expert_parallel, context_parallel=plan.context_parallel,
                    replicate="fully_shard" if plan.dp_shard > 1 else "replicate",
                    options={"schedule": plan.schedule, "stages_per_rank": plan.stages_per_rank, "micro_batches": plan.micro_batches,
                             "precision": plan.precision})
    return planner.manual(recipe, name="nearest whole layers", check_memory=False)

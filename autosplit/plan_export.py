"""A plan in the terms of the engines people run: torchtitan's job config and Megatron-LM's flags.

Both engines place whole layers: torchtitan lists each pipeline stage's modules by name
(``module_fqns_per_model_part``: ``tok_embeddings``, ``layers.N``, ``norm``, ``output``), Megatron
writes a layout of layer letters (:mod:`autosplit.megatron_layout`). A plan is read through a
:class:`Names` map from torchtitan's llama3 names to the model's (:data:`TRANSFORMERS_LLAMA`, for a
transformers Llama, Qwen or Mistral, is found by itself, as is a model named as torchtitan's own):
:func:`stage_parts` gives each stage's layers, or an :class:`~autosplit.errors.ExportError` where
the plan cuts inside a layer, holds parameters the map does not name, or runs a schedule the engine
does not. Nothing here costs: a plan that cuts inside a layer is refused with the option that keeps
layers whole (``expressible_in=``, :func:`~autosplit.compiler.constraints.engine_groups`), under which
the planner finds the best plan an engine runs and the report gives what that costs.

The batch figures come from :attr:`~autosplit.plans.Plan.batch` (rows of the global batch): the
micro-batch size is ``batch / (data_parallel · micro_batches)``.

Usage::

    print(plan.export("megatron"))      # --pipeline-model-parallel-layout Et*2|(t*2|)*34,t*3|(t*2|)*3,tL …
    print(plan.export("torchtitan"))    # [parallelism] … module_fqns_per_model_part = [["tok_embeddings", …], …]
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autosplit import schedules
from autosplit.errors import ConstraintError, ExportError, LayerCutError, advice
from autosplit.megatron_layout import check, format_layout

Plan = Any
"""A :class:`~autosplit.plans.Plan` (not imported: the plan imports this module for :meth:`~autosplit.plans.Plan.export`)."""

__all__ = ["ENGINES", "TORCHTITAN_LLAMA3", "TRANSFORMERS_LLAMA", "Names", "export", "layer_paths", "megatron_flags", "module_prefixes",
           "names_for", "stage_parts", "torchtitan_config", "torchtitan_precision"]

ENGINES = ("torchtitan", "megatron")


@dataclass(frozen=True)
class Names:
    """Where torchtitan's llama3 modules are in the model: its paths for the token embedding, the
    container of the repeated layers (``layers.N``), the final norm and the output projection."""

    tok_embeddings: str
    layers: str
    norm: str
    output: str

    def model_path(self, titan: str) -> str:
        """The model's path for one of torchtitan's names (``layers.3`` → ``model.layers.3``)."""
        head, _, rest = titan.partition(".")
        return getattr(self, head) + (f".{rest}" if rest else "")


TRANSFORMERS_LLAMA = Names("model.embed_tokens", "model.layers", "model.norm", "lm_head")
"""A transformers ``LlamaForCausalLM`` (and Qwen2/3, Mistral: the same module names)."""
TORCHTITAN_LLAMA3 = Names("tok_embeddings", "layers", "norm", "output")
"""torchtitan's own llama3 ``Transformer``."""

_TORCHTITAN_SCHEDULES = {name: entry.torch_class.removeprefix("Schedule") for name, entry in schedules.REGISTRY.items()
                         if entry.torch_class}
"""autosplit's schedule → torchtitan's ``pipeline_parallel_schedule`` (torch's class without its prefix)."""


def module_prefixes(paths: Collection[str]) -> set[str]:
    """Every module path at every level of ``paths`` (a graph's nodes name their innermost module only)."""
    return {".".join(p.split(".")[:k]) for p in paths if p for k in range(1, p.count(".") + 2)}


def layer_paths(paths: Collection[str], names: Names) -> list[str]:
    """The repeated layers among module ``paths`` (``model.layers.N``, by ``names``), in layer order."""
    layer = re.compile(re.escape(names.layers) + r"\.(\d+)")
    return sorted((p for p in paths if layer.fullmatch(p)), key=lambda p: int(p.rsplit(".", 1)[1]))


def names_for(paths: Collection[str], names: Names | Mapping[str, str] | None = None) -> Names:
    """``names`` (a :class:`Names`, or a mapping of its four fields), or the preset whose modules are
    among ``paths`` (a plan's :attr:`~autosplit.plans.Plan.module_stages`, a capture's module paths)."""
    if isinstance(names, Mapping):
        missing = sorted(set(Names.__dataclass_fields__) - set(names))
        if missing:
            raise ExportError(advice(
                f"the name map {dict(names)} leaves out {missing}", "a map names where each of torchtitan's llama3 modules is",
                "give tok_embeddings, layers, norm and output",
            ))
        return Names(**{k: str(names[k]) for k in Names.__dataclass_fields__})
    if names is not None:
        return names
    for preset in (TRANSFORMERS_LLAMA, TORCHTITAN_LLAMA3):
        if all(p in paths for p in (preset.tok_embeddings, f"{preset.layers}.0", preset.norm, preset.output)):
            return preset
    top = sorted({p for p in paths if p and p.count(".") <= 1})[:8]
    raise ExportError(advice(
        f"the model's modules ({top} …) are not named as a transformers Llama's or torchtitan's llama3",
        "an engine's config names the embedding, the layers, the final norm and the output",
        "pass names={'tok_embeddings': ..., 'layers': ..., 'norm': ..., 'output': ...} with the model's paths",
    ))


def _holders(plan: Plan) -> list[str]:
    """The modules that hold parameters, as the plan's stages name them (layer ranges expanded)."""
    out = []
    for stage in plan.stages:
        for name in stage.modules:
            ranged = re.fullmatch(r"(.+)\.(\d+)[–-](\d+)", name)
            out += [f"{ranged[1]}.{i}" for i in range(int(ranged[2]), int(ranged[3]) + 1)] if ranged else [name]
    return out


def stage_parts(plan: Plan, names: Names) -> tuple[tuple[str, ...], ...]:
    """Each stage's modules in torchtitan's names, in order (``tok_embeddings``, ``layers.N`` …,
    ``norm``, ``output``), or an :class:`ExportError` naming what an engine cannot place."""
    layers = layer_paths(plan.module_stages.keys(), names)
    units = [("tok_embeddings", names.tok_embeddings), *((f"layers.{path.rsplit('.', 1)[1]}", path) for path in layers),
             ("norm", names.norm), ("output", names.output)]
    mapped = [path for _, path in units]
    stray = [h for h in _holders(plan) if h != "(root)" and not any(h == p or h.startswith(p + ".") or p.startswith(h + ".")
                                                                   for p in mapped)]
    if stray or "(root)" in _holders(plan):
        what = stray or ["(the root module's own parameters)"]
        raise ExportError(advice(
            f"parameters of {what[:4]} are in none of the modules the name map places ({names})",
            "an engine's config places only the embedding, the layers, the final norm and the output",
            "pass names= mapping torchtitan's names onto the modules that hold these parameters, or export a model of that form",
        ))
    parts: list[list[str]] = [[] for _ in plan.stages]
    for titan, path in units:
        found = plan.module_stages.get(path)
        if not found:
            raise ExportError(advice(f"the plan runs no node of {path!r} ({titan})", "the name map points at a module the model "
                                     "does not call", "pass names= with the model's own paths"))
        if len(found) > 1:
            raise LayerCutError(advice(
                f"the plan cuts inside {path!r} (torchtitan's {titan}): its nodes run on stages {list(found)}",
                "torchtitan's module lists and Megatron's layouts place whole layers only",
                "plan with expressible_in='torchtitan' or 'megatron' (every layer kept whole; the report gives the step it costs "
                f"against this plan's {plan.step_time:.4g} s), or with together=[[{path!r}]]",
            ))
        parts[found[0]].append(titan)
    return tuple(tuple(p) for p in parts)


def _engine_schedule(plan: Plan, engine: str) -> str:
    entry = schedules.lookup(plan.schedule)
    pp = len(plan.stages) // plan.stages_per_rank
    if engine == "torchtitan" and plan.schedule in _TORCHTITAN_SCHEDULES:
        return _TORCHTITAN_SCHEDULES[plan.schedule]
    if engine == "megatron" and (plan.schedule in ("1f1b", "interleaved1f1b") or pp == 1):
        return "interleaved 1F1B" if plan.stages_per_rank > 1 else "1F1B"
    runs = sorted(_TORCHTITAN_SCHEDULES) if engine == "torchtitan" else ["1f1b", "interleaved1f1b"]
    raise ExportError(advice(
        f"{engine} does not run the {plan.schedule!r} schedule ({entry.summary})", f"{engine}'s pipeline runs {runs}",
        f"plan with schedule= one of {runs}",
    ))


def _micro_batch_size(plan: Plan) -> int:
    rows = plan.batch // max(1, plan.data_parallel * plan.micro_batches)
    if plan.batch < 1 or rows * plan.data_parallel * plan.micro_batches != plan.batch:
        raise ExportError(advice(
            f"the plan's global batch ({plan.batch or 'unknown'} rows) does not divide into {plan.data_parallel} copies × "
            f"{plan.micro_batches} micro-batches", "an engine's config gives the micro-batch size in rows",
            "re-plan with a batch they divide (a plan file from before autosplit recorded its batch: plan it again)",
        ))
    return rows


def _recompute(plan: Plan, layers: int, engine: str) -> str:
    """``"none"``, ``"full"`` (every layer recomputed, all micro-batches) or ``"partial"`` (some); a plan
    that recomputes selectively is refused: neither engine keeps what autosplit's policy keeps."""
    if plan.recompute_selective:
        raise ExportError(advice(
            f"the plan recomputes {len(plan.recompute)} blocks selectively, keeping every matmul's and attention's output",
            f"{engine} keeps other tensors: torchtitan's selective op mode recomputes every second mm as well, Megatron's "
            "selective granularity recomputes core attention only; the plan's memory and step would not hold there",
            "plan with selective=False for an engine, or keep autosplit's runtime for this plan",
        ))
    return "none" if not plan.recompute else "full" if len(plan.recompute) >= layers and not plan.recompute_partial else "partial"


def torchtitan_config(plan: Plan, names: Names, *, form: str = "toml") -> str:
    """torchtitan's parallelism settings for ``plan``: ``form="toml"``, the ``[parallelism]``,
    ``[activation_checkpoint]`` and ``[training]`` tables of a v0.2 job config (the output layer named
    ``output``); ``form="python"``, a function that sets the same on a ``Trainer.Config`` of the Python
    config registry torchtitan uses since 2026 (the output layer named ``lm_head``, micro-batches as
    ``num_pp_microbatches``, activation checkpointing as ``FullAC.Config()`` or ``None``)."""
    parts = stage_parts(plan, names)
    layers = sum(p.startswith("layers.") for part in parts for p in part)
    mode = _recompute(plan, layers, "torchtitan")
    if mode == "partial":
        raise ExportError(advice(
            f"the plan recomputes {len(plan.recompute)} of {layers} layers", "torchtitan's activation checkpointing is "
            "'full' (every layer), 'selective' (every n-th layer or per op) or 'none', never a chosen set",
            "plan with checkpointing='full' or 'none', or keep autosplit's runtime for this plan",
        ))
    micro, param_dtype = _micro_batch_size(plan), _torchtitan_precision(plan)
    common = {
        "data_parallel_replicate_degree": plan.dp_replicate, "data_parallel_shard_degree": plan.dp_shard,
        "tensor_parallel_degree": plan.tensor_parallel, "pipeline_parallel_degree": len(plan.stages) // plan.stages_per_rank,
        "pipeline_parallel_schedule": _engine_schedule(plan, "torchtitan"),
    }
    if form == "python":
        fields = {**common, **({"enable_sequence_parallel": plan.sequence_parallel} if plan.tensor_parallel > 1 else {}),
                  "num_pp_microbatches": plan.micro_batches,
                  "module_fqns_per_model_part": [["lm_head" if p == "output" else p for p in part] for part in parts]}
        lines = [f"    config.parallelism.{k} = {v!r}\n" for k, v in fields.items()]
        lines.append(f"    config.training.mixed_precision_param = {param_dtype!r}\n")
        return ("from torchtitan.distributed.activation_checkpoint import FullAC\n\n\n" if mode == "full" else "") + (
            "def autosplit_layout(config):\n"
            f'    """autosplit\'s plan on a Trainer.Config: predicted step {plan.step_time:.4g} s; global batch {plan.batch} rows, '
            f'{plan.micro_batches} micro-batches of {micro} per data-parallel copy."""\n'
            + "".join(lines)
            + f"    config.activation_checkpoint = {'FullAC.Config()' if mode == 'full' else 'None'}\n    return config\n")
    if form != "toml":
        raise ExportError(advice(f"form={form!r}", "torchtitan reads a TOML job config or a Python one", "pass 'toml' or 'python'"))
    tables: dict[str, dict[str, object]] = {
        "parallelism": {**common, "pipeline_parallel_microbatch_size": micro, "module_fqns_per_model_part": [list(p) for p in parts]},
        "activation_checkpoint": {"mode": mode},
        # without a pipeline, torchtitan accumulates gradients over global / (local · dp) steps: the micro-batches
        "training": {"local_batch_size": plan.batch // plan.data_parallel if common["pipeline_parallel_degree"] > 1 else micro,
                     "global_batch_size": plan.batch, "mixed_precision_param": param_dtype},
    }
    return "\n".join(f"[{table}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()) for table, fields in tables.items())


def torchtitan_precision(param: str, *, sharded: bool, split: bool) -> str:
    """The precision torchtitan trains in with ``training.mixed_precision_param = param``
    (``maybe_enable_amp``, torchtitan v0.2.2): FSDP2's ``MixedPrecisionPolicy`` where it shards
    (``"bf16-fsdp"``), autocast under DDP or on one device (``"bf16-mixed"``), and fp32 with tp or pp
    (``split``) but no FSDP, or for ``"float32"``."""
    if param not in ("bfloat16", "float32"):
        raise ConstraintError(advice(f"torchtitan mixed_precision_param {param!r}", "torchtitan takes 'bfloat16' or 'float32'",
                                     "write one of the two"))
    if param == "float32" or (split and not sharded):
        return "fp32"
    return "bf16-fsdp" if sharded else "bf16-mixed"


def _torchtitan_precision(plan: Plan) -> str:
    """torchtitan's ``training.mixed_precision_param`` for the plan: the one it trains in the plan's
    precision with (:func:`torchtitan_precision`), else an :class:`ExportError`."""
    param = "float32" if plan.precision == "fp32" else "bfloat16"
    pp = len(plan.stages) // plan.stages_per_rank
    if torchtitan_precision(param, sharded=plan.dp_shard > 1, split=plan.tensor_parallel > 1 or pp > 1) == plan.precision:
        return param
    raise ExportError(advice(
        f"precision={plan.precision!r} on dp_shard {plan.dp_shard}, tp {plan.tensor_parallel}, pp {pp}",
        "torchtitan casts to bf16 with FSDP2's MixedPrecisionPolicy where it shards, with autocast only under DDP or on "
        "one device, and not at all otherwise",
        "plan with precision='bf16-fsdp' and a sharded layout (or 'bf16-mixed' without tp or pp, or 'fp32')",
    ))


def megatron_flags(plan: Plan, names: Names) -> str:
    """Megatron-LM's command-line flags for ``plan``: the layout and the degrees and batch sizes with it."""
    parts = stage_parts(plan, names)
    pp = len(plan.stages) // plan.stages_per_rank
    _engine_schedule(plan, "megatron")
    if plan.dp_shard > 1 and plan.dp_replicate > 1:
        raise ExportError(advice(
            f"the plan shards over {plan.dp_shard} copies and replicates over {plan.dp_replicate}", "the Megatron-FSDP flags "
            "autosplit writes shard over every data-parallel copy, not over a part of them", "plan with "
            "replicate='fully_shard' over all copies, or 'replicate'",
        ))
    letters = [tuple("E" if p == "tok_embeddings" else "L" if p == "output" else "t" for p in part if p != "norm") for part in parts]
    first_norm = next(s for s, part in enumerate(parts) if "norm" in part)
    if first_norm != len(parts) - 1 or "output" not in parts[-1]:
        raise ExportError(advice(
            f"the plan puts the final norm on stage {first_norm} and the output on stage "
            f"{next(s for s, part in enumerate(parts) if 'output' in part)} of {len(parts)}",
            "Megatron's loss stage L holds the final norm, the output layer and the loss together, last", "plan with "
            f"together=[[{names.norm!r}, {names.output!r}]], or keep autosplit's runtime for this plan",
        ))
    layout = format_layout(letters)
    check(letters, num_layers=sum(c == "t" for stage in letters for c in stage), pipeline=pp)
    flags = [
        f"--tensor-model-parallel-size {plan.tensor_parallel}", f"--pipeline-model-parallel-size {pp}",
        f"--pipeline-model-parallel-layout '{layout}'", f"--micro-batch-size {_micro_batch_size(plan)}",
        f"--global-batch-size {plan.batch}",
    ]
    flags += ["--sequence-parallel"] if plan.sequence_parallel and plan.tensor_parallel > 1 else []
    # FSDP2's fully_shard is Megatron-FSDP's optim_grads_params: parameters, gradients and optimizer state sharded
    flags += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params"] if plan.dp_shard > 1 else []
    flags += ["--bf16"] if plan.precision in ("bf16", "bf16-mixed", "bf16-fsdp") else ["--fp16"] if plan.precision == "fp16-mixed" else []
    flags += _megatron_recompute(plan, parts, names)
    note = (f"# virtual pipeline size {plan.stages_per_rank}: Megatron derives it from the layout ({len(parts)} stages over pp {pp}); "
            "its own virtual-pipeline flags may not be given with a layout")
    return " \\\n  ".join(flags) + f"\n{note}\n"


def _megatron_recompute(plan: Plan, parts: Sequence[Sequence[str]], names: Names) -> list[str]:
    """Megatron's recompute flags: ``uniform`` 1 for every layer; ``block`` N where each stage recomputes
    its first N layers (all of them where it has fewer); anything else is refused."""
    marks = [[f"{names.layers}.{p.split('.')[1]}" in plan.recompute for p in part if p.startswith("layers.")] for part in parts]
    done = [sum(m) for m in marks]
    if not any(done):
        return []
    _recompute(plan, len(plan.recompute), "Megatron")
    if plan.recompute_partial:
        raise ExportError(advice(
            f"the plan keeps some micro-batches' activations of {[p.block for p in plan.recompute_partial][:3]}",
            "Megatron recomputes a layer for every micro-batch or for none", "plan with checkpointing='full' or 'none'",
        ))
    if all(all(m) for m in marks):
        return ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    n = max(done)
    if all(m == [True] * min(n, len(m)) + [False] * (len(m) - min(n, len(m))) for m in marks):
        return ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {n}"]
    raise ExportError(advice(
        f"the plan recomputes {done} layers on its stages, not the first ones of each alike",
        "Megatron's block recomputation recomputes the first N layers of every stage", "plan with checkpointing='full' or 'none'",
    ))


def export(plan: Plan, engine: str, *, names: Names | Mapping[str, str] | None = None, form: str = "toml") -> str:
    """``plan`` as ``engine`` reads it (``"torchtitan"``: a job config, ``form`` ``"toml"`` or
    ``"python"``; ``"megatron"``: command-line flags)."""
    if engine not in ENGINES:
        raise ExportError(advice(f"no exporter for engine {engine!r}", "autosplit writes plans for torchtitan and Megatron-LM",
                                 f"pass one of {ENGINES}"))
    resolved = names_for(plan.module_stages.keys(), names)
    return torchtitan_config(plan, resolved, form=form) if engine == "torchtitan" else megatron_flags(plan, resolved)

"""A plan in the terms of the engines people run: torchtitan's job config and Megatron-LM's flags.

Both engines place whole layers: torchtitan lists each pipeline stage's modules by name
(``module_fqns_per_model_part``: ``tok_embeddings``, ``layers.N``, ``norm`` and the output layer,
``lm_head`` in torchtitan 0.3, ``output`` in 0.2), Megatron writes a layout of layer letters
(:mod:`autosplit.megatron_layout`). A plan is read through a :class:`Names` map from torchtitan's
llama3 names to the model's (:data:`TRANSFORMERS_LLAMA`, for a transformers Llama, Qwen or Mistral, is
found by itself, as are models named as torchtitan 0.3's or 0.2's own): :func:`stage_parts` gives each
stage's layers, or an :class:`~autosplit.errors.ExportError` where the plan cuts inside a layer, where
the lists would not hold every parameter of the model exactly once (an engine drops a module no list
names), or where it runs a schedule the engine does not. Modules that hold only buffers (a rotary
embedding's tables) are no engine's concern: each engine builds them with the layers.

Every export names the release it was written for and was tested on (:data:`RELEASES`): the
Python form torchtitan 0.3's ``Trainer.Config``, the TOML form the 0.2 line (the last that reads
TOML job configs), the flags Megatron-Core 0.16. Nothing here costs: a plan that cuts inside a layer is refused with the option that keeps
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
from autosplit.plan_records import FP8_SHAPES

Plan = Any
"""A :class:`~autosplit.plans.Plan` (not imported: the plan imports this module for :meth:`~autosplit.plans.Plan.export`)."""

__all__ = ["ENGINES", "RELEASES", "TORCHTITAN_LLAMA3", "TORCHTITAN_LLAMA3_0_2", "TRANSFORMERS_LLAMA", "Names", "export", "layer_paths",
           "megatron_flags", "module_prefixes", "names_for", "stage_parts", "torchtitan_config", "torchtitan_precision"]

ENGINES = ("torchtitan", "megatron")
RELEASES = {"torchtitan python": "0.3", "torchtitan toml": "0.2", "megatron": "0.16"}
"""The engine release each form is written for: torchtitan 0.3 reads Python configs only, 0.2 TOML job
configs; Megatron-Core (``megatron-core`` on the registry) 0.16 parses the layout flags."""
OUTPUT_NAME = {"0.3": "lm_head", "0.2": "output"}
"""What each torchtitan release calls the output layer in its llama3 model and module lists."""


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
TORCHTITAN_LLAMA3 = Names("tok_embeddings", "layers", "norm", "lm_head")
"""torchtitan 0.3's own ``Llama3Model`` (and its other decoders: the same module names)."""
TORCHTITAN_LLAMA3_0_2 = Names("tok_embeddings", "layers", "norm", "output")
"""torchtitan 0.2's llama3 ``Transformer``."""

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
    for preset in (TRANSFORMERS_LLAMA, TORCHTITAN_LLAMA3, TORCHTITAN_LLAMA3_0_2):
        if all(p in paths for p in (preset.tok_embeddings, f"{preset.layers}.0", preset.norm, preset.output)):
            return preset
    top = sorted({p for p in paths if p and p.count(".") <= 1 and not p.startswith("_")})[:8]  # not torch.export's own (_guards_fn)
    raise ExportError(advice(
        f"the model's modules ({top} …) are not named as a transformers Llama's or torchtitan's llama3 (0.3: lm_head; 0.2: output)",
        "an engine's config names the embedding, the layers, the final norm and the output",
        "pass names={'tok_embeddings': ..., 'layers': ..., 'norm': ..., 'output': ...} with the model's paths",
    ))


def stage_parts(plan: Plan, names: Names, parameters: Collection[str] | None = None) -> tuple[tuple[str, ...], ...]:
    """Each stage's modules in torchtitan's names, in order (``tok_embeddings``, ``layers.N`` …,
    ``norm``, ``output``), or an :class:`ExportError` naming what an engine cannot place: a cut inside a
    module, or ``parameters`` (the model's, each tied one under every name; default: the plan's record
    of them, :attr:`~autosplit.plans.Plan.parameters`) that the lists would not hold exactly once."""
    layers = layer_paths(plan.module_stages.keys(), names)
    units = [("tok_embeddings", names.tok_embeddings), *((f"layers.{path.rsplit('.', 1)[1]}", path) for path in layers),
             ("norm", names.norm), ("output", names.output)]
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
    _check_coverage([path for _, path in units], names, plan.parameters if parameters is None else parameters)
    return tuple(tuple(p) for p in parts)


def _check_coverage(placed: Sequence[str], names: Names, parameters: Collection[str]) -> None:
    """Refuse module lists that would not hold every one of ``parameters`` exactly once: an engine keeps
    only the modules its lists name (torchtitan's split sets the rest to ``None``), so a parameter no list
    holds would silently not be trained, and one two lists hold would be two parameters."""
    if not parameters:
        raise ExportError(advice(
            "the plan records no parameter names of its model (a plan file written before autosplit recorded them)",
            "an export is checked against the model: every parameter placed by exactly one module list",
            "pass model= to export, or plan the model again",
        ))
    holders = {p: [m for m in placed if p == m or p.startswith(m + ".")] for p in parameters}
    left = sorted(p for p, found in holders.items() if not found)
    twice = sorted(p for p, found in holders.items() if len(found) > 1)
    if left or twice:
        what = ([f"{len(left)} parameters ({left[:4]} …) are in none of the modules the lists place"] if left else []) + (
            [f"{len(twice)} parameters ({twice[:4]} …) are in two of the modules the lists place ({holders[twice[0]]})"] if twice else [])
        raise ExportError(advice(
            f"{'; '.join(what)} (the name map {names})",
            "an engine's config places only the embedding, the layers, the final norm and the output: what no list names "
            "is dropped from the model the engine trains",
            "pass names= mapping torchtitan's names onto the modules that hold these parameters, or export a model of that form",
        ))


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


def torchtitan_config(plan: Plan, names: Names, *, form: str = "toml", parameters: Collection[str] | None = None) -> str:
    """torchtitan's parallelism settings for ``plan``: ``form="python"``, a function that sets them on a
    torchtitan 0.3 ``Trainer.Config`` (the output layer named ``lm_head``, micro-batches as
    ``training.local_batch_size // parallelism.pipeline_parallel_microbatch_size``, activation
    checkpointing as ``FullAC.Config()`` or ``None``); ``form="toml"``, the ``[parallelism]``,
    ``[activation_checkpoint]`` and ``[training]`` tables of a torchtitan 0.2 job config (the output
    layer named ``output``: 0.2 is the last line that reads TOML)."""
    if form not in ("toml", "python"):
        raise ExportError(advice(f"form={form!r}", "torchtitan 0.3 reads a Python config, 0.2 a TOML job config",
                                 "pass 'python' (0.3) or 'toml' (0.2)"))
    release = RELEASES[f"torchtitan {form}"]
    parts = [[OUTPUT_NAME[release] if p == "output" else p for p in part] for part in stage_parts(plan, names, parameters)]
    layers = sum(p.startswith("layers.") for part in parts for p in part)
    mode = _recompute(plan, layers, "torchtitan")
    if mode == "partial":
        raise ExportError(advice(
            f"the plan recomputes {len(plan.recompute)} of {layers} layers", "torchtitan's activation checkpointing is "
            "'full' (every layer), 'selective' (every n-th layer or per op) or 'none', never a chosen set",
            "plan with checkpointing='full' or 'none', or keep autosplit's runtime for this plan",
        ))
    megatron_only = [(what, why, instead) for used, what, why, instead in (  # what the plan runs that torchtitan has no form for
        (plan.context_parallel > 1 and plan.cp_comm != "p2p", f"exchanges each sequence's shards over cp {plan.context_parallel} by "
         f"all-to-all (cp_comm={plan.cp_comm!r})", "torchtitan's context parallelism passes keys and values round a ring", "cp_comm='p2p'"),
        (plan.expert_parallel > 1 and plan.ep_overlap, f"overlaps its ep {plan.expert_parallel} all-to-alls with another micro-batch "
         "(ep_overlap=True)", "torchtitan dispatches each micro-batch's tokens in turn", "ep_overlap=False")) if used]
    if megatron_only:
        raise ExportError(advice("the plan " + " and ".join(w for w, _, _ in megatron_only), "; ".join(y for _, y, _ in megatron_only),
                                 f"plan with {' and '.join(i for *_, i in megatron_only)} for torchtitan, or export this plan to Megatron"))
    micro, pp = _micro_batch_size(plan), len(plan.stages) // plan.stages_per_rank
    parallelism: dict[str, object] = {
        "data_parallel_replicate_degree": plan.dp_replicate, "data_parallel_shard_degree": plan.dp_shard,
        "tensor_parallel_degree": plan.tensor_parallel, "pipeline_parallel_degree": pp,
        "pipeline_parallel_schedule": _engine_schedule(plan, "torchtitan"), "pipeline_parallel_microbatch_size": micro,
        **({"enable_sequence_parallel": plan.sequence_parallel} if plan.tensor_parallel > 1 else {}),
        # experts whole on each of their ranks, borrowed from dp_shard × tp (autosplit.passes.ep_costs)
        **({"expert_parallel_degree": plan.expert_parallel, "expert_tensor_parallel_degree": 1} if plan.expert_parallel > 1 else {}),
        **({"context_parallel_degree": plan.context_parallel} if plan.context_parallel > 1 else {}),
        "module_fqns_per_model_part": parts,
    }
    # without a pipeline, torchtitan accumulates gradients over global / (local · dp) steps: the micro-batches
    param, note = _torchtitan_precision(plan, release)
    float8 = _torchtitan_float8(plan, names, release, plan.dp_shard > 1)
    training: dict[str, object] = {"local_batch_size": plan.batch // plan.data_parallel if pp > 1 else micro,
                                   "global_batch_size": plan.batch, "mixed_precision_param": param}
    if release != "0.2" and pp > 1:  # 0.3 captures CUDA graphs by default, which its Trainer.Config refuses under a pipeline
        training["disable_cuda_graphs"] = True
    head = f"torchtitan {release}, written by autosplit: predicted step {plan.step_time:.4g} s; global batch {plan.batch} rows, " \
           f"{plan.micro_batches} micro-batches of {micro} per data-parallel copy"
    if form == "python":
        lines = [f"    config.parallelism.{k} = {v!r}\n" for k, v in parallelism.items()]
        lines += [f"    config.training.{k} = {v!r}\n" for k, v in training.items()]
        if float8:  # 0.3 converts the model's config tree, as its model_registry(converters=...) does
            lines.append(f"    config.model_spec.model = Float8LinearConverter.Config({', '.join(f'{k}={v!r}' for k, v in float8.items())})"
                         ".build().convert(config.model_spec.model)\n")
        imports = "".join(f"{line}\n" for line in (
            "from torchtitan.distributed.activation_checkpoint import FullAC" if mode == "full" else "",
            "from torchtitan.components.quantization.float8 import Float8LinearConverter" if float8 else "") if line)
        return (imports + "\n\n" if imports else "") + (
            f'def autosplit_layout(config):\n    """Sets autosplit\'s plan on a Trainer.Config of {head}."""\n'
            + (f"    # {note}\n" if note else "") + "".join(lines)
            + f"    config.activation_checkpoint = {'FullAC.Config()' if mode == 'full' else 'None'}\n    return config\n")
    tables: dict[str, dict[str, object]] = {"parallelism": parallelism, "activation_checkpoint": {"mode": mode}, "training": training}
    if float8:
        tables |= {"model": {"converters": ["quantize.linear.float8"]}, "quantize.linear.float8": float8}
    return f"# {head}\n# torchtitan 0.3 reads Python configs only: plan.export('torchtitan', form='python')\n" + "\n".join(
        f"[{table}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()) for table, fields in tables.items())


def _torchtitan_float8(plan: Plan, names: Names, release: str, sharded: bool) -> dict[str, object]:
    """torchtitan's float8 converter settings for the plan's FP8 linears (empty without): 0.2's
    ``[quantize.linear.float8]`` table, 0.3's ``Float8LinearConverter.Config`` fields. torchtitan converts every
    linear of FP8's shapes that ``filter_fqns`` does not name, so the plan's other bf16 linears must be the
    output layer alone (named by the release's name for it); 0.3 runs rowwise scaling only."""
    if plan.float8 is None:
        return {}
    if plan.float8 not in ("tensorwise", "rowwise") or (release == "0.3" and plan.float8 != "rowwise"):
        raise ExportError(advice(
            f"the plan runs its linears in FP8 {plan.float8!r}", f"torchtitan {release}'s Float8 linear converter runs "
            + ("rowwise scaling only" if release == "0.3" else "tensorwise and rowwise scaling"),
            "plan with float8='rowwise' for 0.3" if release == "0.3" else "plan with float8='tensorwise' or 'rowwise'",
        ))
    output = names.model_path("output")
    other = [(p, why) for p, why in plan.float8_kept if p != output and FP8_SHAPES not in why]
    if other:
        raise ExportError(advice(
            f"the plan keeps {len(other)} linears of FP8's shapes in bf16 besides the output layer: {other[:2]}",
            "torchtitan converts every such linear its filter_fqns do not name, and names the modules in its own llama3 terms",
            "plan with float8='tensorwise' (or 'rowwise') and float8_exclude=None, which converts as torchtitan does",
        ))
    kept = [OUTPUT_NAME[release]] if any(p == output for p, _ in plan.float8_kept) else []
    if release == "0.3":
        return {"recipe_name": plan.float8, "filter_fqns": kept}
    # FP8 all-gathers cast the fp32 shards; the plan gathers the bf16 policy's copies (and costs them so) under "bf16-fsdp"
    gathered = plan.float8 == "tensorwise" and sharded and plan.precision != "bf16-fsdp"
    return {"recipe_name": plan.float8, "filter_fqns": kept, "enable_fsdp_float8_all_gather": gathered,
            "precompute_float8_dynamic_scale_for_fsdp": gathered}


def torchtitan_precision(param: str, *, sharded: bool, split: bool, release: str = "0.2") -> str:
    """The precision torchtitan trains in with ``training.mixed_precision_param = param``. 0.3 applies
    FSDP2's ``MixedPrecisionPolicy`` on every layout (``apply_fsdp_to_decoder`` runs with a shard degree
    of 1 too): ``"bf16-fsdp"``. 0.2 (``maybe_enable_amp``, v0.2.2) applies it where it shards
    (``"bf16-fsdp"``), autocast under DDP or on one device (``"bf16-mixed"``), and fp32 with tp or pp
    (``split``) but no FSDP; ``"float32"`` is fp32 in both."""
    if param not in ("bfloat16", "float32"):
        raise ConstraintError(advice(f"torchtitan mixed_precision_param {param!r}", "torchtitan takes 'bfloat16' or 'float32'",
                                     "write one of the two"))
    if param == "float32" or (release == "0.2" and split and not sharded):
        return "fp32"
    return "bf16-fsdp" if sharded or release != "0.2" else "bf16-mixed"


def _torchtitan_precision(plan: Plan, release: str) -> tuple[str, str]:
    """torchtitan's ``training.mixed_precision_param`` for the plan, and a note where ``release`` casts other
    than the plan was costed: the one ``release`` trains in the plan's precision with
    (:func:`torchtitan_precision`); under 0.3, whose only bf16 path is FSDP2's policy, ``"bf16-mixed"``
    (autocast) too, said so; else an :class:`ExportError`."""
    param = "float32" if plan.precision == "fp32" else "bfloat16"
    pp = len(plan.stages) // plan.stages_per_rank
    if torchtitan_precision(param, sharded=plan.dp_shard > 1, split=plan.tensor_parallel > 1 or pp > 1, release=release) == plan.precision:
        return param, ""
    if release != "0.2" and plan.precision == "bf16-mixed":
        return param, ("precision: costed as bf16-mixed (autocast); torchtitan 0.3 casts the parameters with FSDP2's "
                       "MixedPrecisionPolicy instead (bf16 matmuls either way; it saves bf16 where autocast keeps some fp32): "
                       "plan with precision='bf16-fsdp' to cost it as torchtitan runs it")
    how = ("casts to bf16 with FSDP2's MixedPrecisionPolicy on every layout" if release != "0.2" else "casts to bf16 with FSDP2's "
           "MixedPrecisionPolicy where it shards, with autocast only under DDP or on one device, and not at all otherwise")
    raise ExportError(advice(
        f"precision={plan.precision!r} on dp_shard {plan.dp_shard}, tp {plan.tensor_parallel}, pp {pp}", f"torchtitan {release} {how}",
        "plan with precision='bf16-fsdp' (or 'fp32')" if release != "0.2" else
        "plan with precision='bf16-fsdp' and a sharded layout (or 'bf16-mixed' without tp or pp, or 'fp32')",
    ))


def megatron_flags(plan: Plan, names: Names, parameters: Collection[str] | None = None) -> str:
    """Megatron-LM's command-line flags for ``plan``: the layout and the degrees and batch sizes with it."""
    parts = stage_parts(plan, names, parameters)
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
    last = max(s for s, part in enumerate(parts) if part)  # stages after it hold no layer: ranks the plan leaves idle
    if first_norm != last or "output" not in parts[last]:
        raise ExportError(advice(
            f"the plan puts the final norm on stage {first_norm} and the output on stage "
            f"{next(s for s, part in enumerate(parts) if 'output' in part)} of {len(parts)}",
            "Megatron's loss stage L holds the final norm, the output layer and the loss together, last", "plan with "
            f"together=[[{names.norm!r}, {names.output!r}]], or keep autosplit's runtime for this plan",
        ))
    layout = format_layout(letters)
    check(letters, num_layers=sum(c == "t" for stage in letters for c in stage), pipeline=pp, empty_stages=True)
    flags = [
        f"--tensor-model-parallel-size {plan.tensor_parallel}", f"--pipeline-model-parallel-size {pp}",
        f"--pipeline-model-parallel-layout '{layout}'", f"--micro-batch-size {_micro_batch_size(plan)}",
        f"--global-batch-size {plan.batch}",
    ]
    flags += ["--sequence-parallel"] if plan.sequence_parallel and plan.tensor_parallel > 1 else []
    flags += [f"--expert-model-parallel-size {plan.expert_parallel}", "--expert-tensor-parallel-size 1"] if plan.expert_parallel > 1 else []
    # Megatron's batch-level overlap of the all-to-alls needs the weight gradients' compute delayed (Megatron-Core 0.14)
    flags += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"] if plan.expert_parallel > 1 and plan.ep_overlap else []
    flags += [f"--context-parallel-size {plan.context_parallel}", f"--cp-comm-type {plan.cp_comm}"] if plan.context_parallel > 1 else []
    # FSDP2's fully_shard is Megatron-FSDP's optim_grads_params: parameters, gradients and optimizer state sharded
    flags += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params"] if plan.dp_shard > 1 else []
    flags += ["--bf16"] if plan.precision in ("bf16", "bf16-mixed", "bf16-fsdp") else ["--fp16"] if plan.precision == "fp16-mixed" else []
    flags += _megatron_recompute(plan, parts, names)
    flags += _megatron_float8(plan, names)
    notes = [f"# Megatron-Core {RELEASES['megatron']} (the flags of megatron-lm pretraining), written by autosplit: predicted step "
             f"{plan.step_time:.4g} s",
             f"# virtual pipeline size {plan.stages_per_rank}: Megatron derives it from the layout ({len(parts)} stages over pp {pp}); "
             "its own virtual-pipeline flags may not be given with a layout"]
    idle = [k for k, stage in enumerate(letters) if not stage]
    if idle:
        notes.append(f"# stages {idle} hold no layer: the plan finds the step shorter with those ranks idle (Megatron relays "
                     "the activations through them; autosplit does not read such a layout back)")
    return " \\\n  ".join(flags) + "\n" + "\n".join(notes) + "\n"


MEGATRON_FP8 = {"tensorwise": "tensorwise", "mxfp8": "mxfp8"}
"""autosplit's FP8 recipe → Megatron's ``--fp8-recipe`` (Transformer Engine's current scaling, FP8-CS; MXFP8)."""


def _megatron_float8(plan: Plan, names: Names) -> list[str]:
    """Megatron's FP8 flags (Transformer Engine converts every linear of its layers, never the output
    layer): the plan must run exactly those in FP8, in a recipe Megatron has."""
    if plan.float8 is None:
        return []
    inside = [p for p, why in plan.float8_kept if p != names.model_path("output") and FP8_SHAPES not in why]
    if plan.float8 not in MEGATRON_FP8 or inside:
        raise ExportError(advice(
            f"the plan runs FP8 {plan.float8!r}" + (f" and keeps {inside[:3]} in bf16" if inside else ""),
            f"Megatron's --fp8-recipe runs {sorted(MEGATRON_FP8)} on every linear of its layers (Transformer Engine), "
            "and keeps the output layer in bf16", "plan with float8='tensorwise' and float8_exclude=None",
        ))
    if not any(p == names.model_path("output") for p, _ in plan.float8_kept):
        raise ExportError(advice("the plan runs the output layer in FP8", "Transformer Engine converts the layers, not the output "
                                 "layer", "plan with float8_exclude=None (the output layer kept in bf16)"))
    return [f"--fp8-format {'hybrid' if plan.float8 == 'tensorwise' else 'e4m3'}", f"--fp8-recipe {MEGATRON_FP8[plan.float8]}"]


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


def export(plan: Plan, engine: str, *, names: Names | Mapping[str, str] | None = None, form: str = "toml", model: Any = None) -> str:
    """``plan`` as ``engine`` reads it (``"torchtitan"``: a job config, ``form`` ``"python"`` for 0.3 or
    ``"toml"`` for 0.2; ``"megatron"``: command-line flags), its module lists checked to hold every
    parameter of ``model`` (an ``nn.Module``, on the meta device too; default: the plan's record of its
    model's parameters) exactly once."""
    if engine not in ENGINES:
        raise ExportError(advice(f"no exporter for engine {engine!r}", "autosplit writes plans for torchtitan and Megatron-LM",
                                 f"pass one of {ENGINES}"))
    resolved = names_for(plan.module_stages.keys(), names)
    parameters = None if model is None else [name for name, _ in model.named_parameters(remove_duplicate=False)]
    if engine == "torchtitan":
        return torchtitan_config(plan, resolved, form=form, parameters=parameters)
    return megatron_flags(plan, resolved, parameters)

"""autosplit's exports judged by the engines' own released code (Megatron-Core 0.16, torchtitan 0.3), as
``scripts/setup.sh`` installs them: Megatron parses and validates every layout autosplit writes and places
the plan's layers on each (pipeline, virtual) rank; torchtitan applies the Python form to its
``Trainer.Config``, splits its own Llama 3 with the exported lists and maps ranks to the plan's stages, and
the stages run one after another equal the whole model; the two parsers accept the same layouts."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autosplit
from autosplit import schedules
from autosplit.compiler.engine_plans import _megatron_flags
from autosplit.errors import CaptureError, ConstraintError, ExportError
from autosplit.megatron_layout import check, parse
from autosplit.plan_export import RELEASES, TORCHTITAN_LLAMA3, names_for, stage_parts

with warnings.catch_warnings():  # Megatron warns at import that Transformer Engine and Apex are absent (a CPU)
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping, _split_module
    from torchtitan.models import llama3 as titan_llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.trainer import Trainer


def test_the_engines_installed_are_the_releases_the_exports_are_written_for():
    from importlib.metadata import version

    assert version("torchtitan").rsplit(".", 1)[0] == RELEASES["torchtitan python"]
    assert version("megatron-core").rsplit(".", 1)[0] == RELEASES["megatron"]


def _titan_llama(layers: int = 4, *, flex: bool = False) -> torch.nn.Module:
    """torchtitan 0.3's own ``Llama3Model``, small; its attention causal scaled-dot-product unless ``flex``."""
    dim, heads, vocab = 64, 4, 256
    config = titan_llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=titan_llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=titan_llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=titan_llama3._output_linear_init(dim)),
        layers=titan_llama3._build_llama3_layers(
            n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=2, hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000, scaling="llama"), attn_backend="flex"),
    )
    if not flex:
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = titan_llama3.Llama3Model(config)
    model.init_states()
    return model


def _hf_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=16, attn_implementation="eager")
    return LlamaForCausalLM(LlamaConfig(**shape)), (torch.randint(0, 128, (8, 8)),)


# -- Megatron-Core ----------------------------------------------------------------------------------------

def _megatron_reads(flags: str, plan: autosplit.Plan, num_layers: int) -> None:
    """Megatron's ``TransformerConfig`` validates the exported layout at the exported sizes, and its layout
    object gives every (pipeline, virtual) rank the layers the plan's stage there holds."""
    value = _megatron_flags(flags)
    pp, layout = int(value["pipeline-model-parallel-size"]), value["pipeline-model-parallel-layout"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.float32,
                                   pipeline_model_parallel_size=pp, tensor_model_parallel_size=int(value["tensor-model-parallel-size"]),
                                   pipeline_model_parallel_layout=layout)
    read = config.pipeline_model_parallel_layout
    vp = read.virtual_pipeline_model_parallel_size
    assert vp == plan.stages_per_rank and pp * vp == len(plan.stages)
    parts = stage_parts(plan, names_for(plan.module_stages.keys()))
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vp if vp > 1 else None)
    try:
        for k, part in enumerate(parts):
            rank, chunk = k % pp, k // pp
            layers = [int(p.split(".")[1]) for p in part if p.startswith("layers.")]
            assert read.get_layer_id_list(vp_stage=chunk, pp_rank=rank) == layers, (k, layout)
            assert (LayerType.embedding in read.layout[rank][chunk]) == ("tok_embeddings" in part)
            assert (LayerType.loss in read.layout[rank][chunk]) == ("output" in part)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def test_megatron_validates_every_layout_autosplit_writes_and_places_the_plans_layers_on_each_rank():
    model, args = _hf_llama(4)
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args, micro_batches=2, schedule="1f1b")
    looped = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args, micro_batches=4, schedule="interleaved1f1b", stages_per_rank=2)
    plans = [planner.plan(), planner.with_options(expressible_in="megatron").plan(), looped.manual("megatron:Et|t|t|tL"),
             looped.manual("megatron:E|t*2|t|tL")]
    for plan in plans:
        _megatron_reads(plan.export("megatron"), plan, num_layers=4)


def test_the_8b_on_8_h100s_exports_to_both_engines_past_its_buffer_only_rotary_module():
    """The issue's case: a transformers Llama-3-8B planned onto 8 H100s (1F1B, bf16-mixed, full recomputation).
    ``model.rotary_emb`` holds buffers only, and the plan finds the step shorter leaving the last rank idle."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    planner = autosplit.Planner(model, ["H100-80GB"] * 8, example_inputs=(autosplit.Spec((8, 8192), torch.long),), schedule="1f1b",
                                precision="bf16-mixed", checkpointing="full", time_limit=2)
    plan = planner.plan()
    flags = planner.export("megatron", plan)
    assert "--recompute-granularity full" in flags and "--bf16" in flags
    _megatron_reads(flags, plan, num_layers=32)
    python = planner.export("torchtitan", plan, form="python")
    assert "FSDP2's MixedPrecisionPolicy" in python  # said: torchtitan 0.3 casts otherwise than autocast
    config = _apply(python)
    lists = config.parallelism.module_fqns_per_model_part
    assert sorted(f for part in lists for f in part) == sorted(["tok_embeddings", "norm", "lm_head", *(f"layers.{i}" for i in range(32))])


# -- the parsers agree -----------------------------------------------------------------------------------

def _megatron_accepts(layout: str, pp: int, layers: int, mtp: int | None) -> bool:
    try:
        PipelineParallelLayerLayout(layout, pp).validate_layer_layout(num_layers=layers, mtp_num_layers=mtp)
    except (AssertionError, ValueError, IndexError, KeyError, NotImplementedError):
        return False
    return True


_PIECE = st.sampled_from(["E", "t", "t", "t", "L", "m", "|", "|", ",", " ", "x", "t*2", "t*3", "(t|)*2", "(tt|)*3", "(|t)*2", "*", "("])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.lists(_PIECE, max_size=12).map("".join), pp=st.sampled_from([1, 2, 4]), layers=st.integers(0, 8),
       mtp=st.sampled_from([None, 0, 1, 2]), frame=st.booleans())
def test_autosplit_accepts_exactly_the_layouts_megatron_core_accepts_but_stages_without_a_layer(body, pp, layers, mtp, frame):
    layout = f"E{body}L" if frame else body  # most layouts Megatron accepts start with E and end with L
    try:
        stages = parse(layout)
        check(stages, num_layers=layers, pipeline=pp, mtp_layers=mtp)
        ours, why = True, ""
    except ConstraintError as e:
        ours, why = False, str(e)
    megatron = _megatron_accepts(layout, pp, layers, mtp)
    if megatron and not ours:
        assert "Megatron accepts that" in why and "without a layer" in why, (layout, why)  # the one place autosplit is stricter
    else:
        assert ours == megatron, (layout, pp, layers, mtp, why)


def test_a_layout_with_a_space_or_an_empty_stage_is_refused_saying_why():
    with pytest.raises(ConstraintError, match="no spaces"):
        parse("Et*8|t*8|t*8 |t*8L")
    assert not _megatron_accepts("Et*8|t*8|t*8 |t*8L", 4, 32, None)
    assert _megatron_accepts("Et*16||t*8|t*8L", 4, 32, None)
    with pytest.raises(ConstraintError, match=re.escape("leaves stages [1] without a layer: Megatron accepts that")):
        check(parse("Et*16||t*8|t*8L"), num_layers=32, pipeline=4)


# -- torchtitan 0.3 ----------------------------------------------------------------------------------------

def _apply(python: str) -> Any:
    """The exported Python form applied to a fresh ``Trainer.Config``, checked again by its own ``__post_init__``."""
    namespace: dict[str, Any] = {}
    exec(compile(python, "autosplit export", "exec"), namespace)
    config = namespace["autosplit_layout"](Trainer.Config())
    return dataclasses.replace(config)


@pytest.mark.parametrize(("devices", "options"), [
    (2, {"schedule": "1f1b", "micro_batches": 2}),
    (2, {"schedule": "interleaved1f1b", "stages_per_rank": 2, "micro_batches": 4}),
    (2, {"schedule": "zbvzerobubble", "stages_per_rank": 2, "micro_batches": 4}),
])
def test_torchtitan_splits_its_own_llama3_with_the_export_and_the_stages_equal_the_model(devices, options):
    model = _titan_llama(4)
    tokens = torch.randint(0, 256, (4, 16))
    planner = autosplit.Planner(model, ["cpu"] * devices, example_inputs=(tokens,), expressible_in="torchtitan", time_limit=2, **options)
    plan = planner.plan()
    config = _apply(planner.export("torchtitan", plan, form="python"))
    par, training = config.parallelism, config.training
    parts = [list(p) for p in stage_parts(plan, TORCHTITAN_LLAMA3)]
    assert par.module_fqns_per_model_part == [["lm_head" if f == "output" else f for f in p] for p in parts]
    assert training.local_batch_size // par.pipeline_parallel_microbatch_size == plan.micro_batches
    assert par.pipeline_parallel_degree == devices and training.mixed_precision_param == "float32"
    entry, stages = schedules.lookup(plan.schedule), len(plan.stages)
    for rank in range(devices):
        titan = _get_pp_rank_to_stage_indices_mapping(rank, devices, par.pipeline_parallel_schedule, stages)
        assert list(titan) == [s for s in range(stages) if entry.rank_of(s, stages, devices) == rank]
    chunks = [_split_module(model, names) for names in par.module_fqns_per_model_part]
    held = [name for chunk in chunks for name, _ in chunk.named_parameters()]
    assert sorted(held) == sorted(name for name, _ in model.named_parameters())  # every parameter, exactly once
    with torch.no_grad():
        out = tokens
        for chunk in chunks:
            out = chunk(out)
        torch.testing.assert_close(out, model(tokens), rtol=0, atol=0)


def test_torchtitans_config_of_either_release_is_read_as_it_means_or_refused_by_name(tmp_path):
    model = _titan_llama(2)
    tokens = torch.randint(0, 256, (4, 16))
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=(tokens,), schedule="1f1b", micro_batches=2, expressible_in="torchtitan")
    plan = planner.plan()
    back = planner.manual(_apply(planner.export("torchtitan", plan, form="python")))  # 0.3's Trainer.Config itself
    assert stage_parts(back, TORCHTITAN_LLAMA3) == stage_parts(plan, TORCHTITAN_LLAMA3) and back.micro_batches == 2
    toml = planner.export("torchtitan", plan)
    assert toml.startswith("# torchtitan 0.2") and '"output"]' in toml and "lm_head" not in toml.split("\n", 2)[2]
    (tmp_path / "job.toml").write_text(toml)
    assert stage_parts(planner.manual(f"torchtitan:{tmp_path / 'job.toml'}"), TORCHTITAN_LLAMA3) == stage_parts(plan, TORCHTITAN_LLAMA3)
    (tmp_path / "mixed.toml").write_text(toml.replace('"output"]', '"lm_head"]'))
    with pytest.raises(ConstraintError, match=r"torchtitan 0.2 config lists 'lm_head', torchtitan 0.3's name .* without its output layer"):
        planner.manual(f"torchtitan:{tmp_path / 'mixed.toml'}")
    with pytest.raises(ConstraintError, match="num_pp_microbatches, which no torchtitan release has"):
        planner.manual({"parallelism": {"pipeline_parallel_degree": 2, "num_pp_microbatches": 2}})
    # context parallelism: torchtitan's own Trainer.Config takes the degree, and reads back as the same plan
    wide = autosplit.Planner(model, ["cpu"] * 4, example_inputs=(tokens,), expressible_in="torchtitan")
    split = wide.manual(autosplit.Recipe([["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]], context_parallel=2,
                                         options=dict(micro_batches=2, schedule="1f1b")))
    titan = _apply(wide.export("torchtitan", split, form="python"))
    assert (titan.parallelism.context_parallel_degree, titan.parallelism.pipeline_parallel_degree) == (2, 2)
    back = wide.manual(titan)
    assert (back.mesh, back.assignment) == (split.mesh, split.assignment) and back.step_time == pytest.approx(split.step_time)
    config = _apply(planner.export("torchtitan", plan, form="python"))
    config.parallelism.module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    with pytest.raises(ConstraintError, match=r"torchtitan 0.3 config lists 'output', torchtitan 0.2's name"):
        planner.manual(config)


def test_an_export_that_would_leave_a_parameter_out_is_refused():
    model, args = _hf_llama(2)
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args, micro_batches=2, schedule="1f1b", expressible_in="megatron")
    plan = planner.plan()
    assert len(plan.parameters) == len(list(model.parameters()))
    model.value_head = torch.nn.Linear(64, 1)  # a module the plan never saw: no engine list would hold it
    for engine in ("megatron", "torchtitan"):
        with pytest.raises(ExportError, match=r"2 parameters \(\['value_head.bias', 'value_head.weight'\] …\) are in none"):
            plan.export(engine, model=model)
    with pytest.raises(ExportError, match="are in two of the modules"):  # a name map whose modules overlap
        plan.export("megatron", names={"tok_embeddings": "model.embed_tokens", "layers": "model.layers", "norm": "lm_head",
                                       "output": "lm_head"})


def test_expressible_in_takes_the_name_map_of_a_model_it_does_not_know():
    from tests.layouts import gpt_case

    gpt, args, *_ = gpt_case()
    names = {"tok_embeddings": "wte", "layers": "blocks", "norm": "ln_f", "output": "head"}
    plan = autosplit.Planner(gpt, ["cpu"] * 2, example_inputs=args, micro_batches=2, schedule="1f1b", expressible_in="megatron",
                             names=names).plan()
    assert all(len(plan.module_stages[f"blocks.{i}"]) == 1 for i in range(2)) and plan.engine_gap is not None
    with pytest.raises(ExportError, match=r"\['wpe.weight'\]"):  # the learned positions: no llama3 module holds them
        plan.export("megatron", names=names)


def test_torchtitans_flex_attention_llama_is_refused_saying_what_to_switch_and_its_names_are_known():
    model = _titan_llama(2, flex=True)
    tokens = torch.randint(0, 256, (4, 16))
    with pytest.raises(CaptureError) as refused:
        autosplit.plan(model, ["cpu"] * 2, example_inputs=(tokens,))
    message = str(refused.value)
    assert "FlexAttention" in message and "ScaledDotProductAttention.Config()" in message
    assert "_guards_fn" not in message and "_pytree" not in message and "attention_masks must be" not in message
    names = names_for([name for name, _ in _titan_llama(2).named_modules()])
    assert names == TORCHTITAN_LLAMA3 and names.output == "lm_head"
    with pytest.raises(ExportError, match=r"\(\['blocks', 'blocks.0'\] …\) are not named as") as unknown:
        names_for(["blocks", "blocks.0", "_guards_fn"])
    assert "_guards_fn" not in str(unknown.value)


def test_fp8_plans_export_to_both_engines_and_read_back_as_the_same_linears(tmp_path, monkeypatch):
    """torchtitan 0.3 converts its own Llama's config with the exported ``Float8LinearConverter`` (rowwise; the check of
    an FP8 GPU passed over on this CPU), 0.2 reads the ``[quantize.linear.float8]`` table, Megatron the ``--fp8-*`` flags;
    each read back converts the plan's linears — every layer's, the output layer kept in bf16."""
    from torchtitan.components.quantization import float8 as titan_float8

    monkeypatch.setattr(titan_float8, "has_cuda_capability", lambda *_: True)
    model = _titan_llama(2)
    tokens = torch.randint(0, 256, (4, 16))
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=(tokens,), schedule="1f1b", micro_batches=2, expressible_in="torchtitan",
                                precision="bf16-fsdp")
    rowwise = planner.with_options(float8="rowwise").plan()
    assert len(rowwise.float8_linears) == 10 and [p for p, _ in rowwise.float8_kept] == ["lm_head"]
    config = Trainer.Config()
    config.model_spec = titan_llama3.model_registry("debugmodel")
    namespace: dict[str, Any] = {}
    exec(compile(planner.export("torchtitan", rowwise, form="python"), "autosplit export", "exec"), namespace)
    config = namespace["autosplit_layout"](config)
    converted = [fqn for fqn, cfg, _, _ in config.model_spec.traverse(Linear.Config) if type(cfg).__qualname__.startswith("Float8Linear")]
    assert converted and all(".layers." in fqn for fqn in converted), converted  # torchtitan's own converter ran on its config
    back = planner.manual(config)
    assert (back.float8, back.float8_linears) == ("rowwise", rowwise.float8_linears)
    planner = planner.with_options(data_parallel=2, replicate="fully_shard")  # 0.2 trains bf16 where FSDP shards
    tensorwise = planner.with_options(float8="tensorwise").plan()
    toml = planner.export("torchtitan", tensorwise)
    # the bf16 policy's copies gathered, as autosplit plans and runs them (not FP8 all-gathers of the fp32 shards)
    assert ('[quantize.linear.float8]\nrecipe_name = "tensorwise"\nfilter_fqns = ["output"]\nenable_fsdp_float8_all_gather = false\n'
            'precompute_float8_dynamic_scale_for_fsdp = false') in toml
    (tmp_path / "job.toml").write_text(toml)
    reader = autosplit.Planner(model, ["cpu"] * 2, example_inputs=(tokens,), precision="bf16-fsdp")  # the whole mesh: dp_shard 2
    back = reader.manual(f"torchtitan:{tmp_path / 'job.toml'}")
    assert (back.float8, back.float8_linears) == ("tensorwise", tensorwise.float8_linears)
    flags = planner.export("megatron", tensorwise)
    assert "--fp8-format hybrid" in flags and "--fp8-recipe tensorwise" in flags
    back = reader.manual(f"megatron:{flags}")
    assert (back.float8, back.float8_linears) == ("tensorwise", tensorwise.float8_linears)
    with pytest.raises(ExportError, match=r"torchtitan 0\.3's Float8 linear converter runs rowwise scaling only"):
        planner.export("torchtitan", tensorwise, form="python")
    with pytest.raises(ExportError, match="keeps 1 linears of FP8's shapes in bf16 besides the output layer"):
        planner.export("torchtitan", planner.with_options(float8="tensorwise", float8_exclude=("lm_head", "layers.0.attention.wo")).plan())

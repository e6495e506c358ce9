"""Plans in the engines' terms: Megatron layouts, torchtitan configs, export and import (issue 49)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import tomllib
import torch

import autosplit
from autosplit.errors import ConstraintError, ExportError, LayerCutError
from autosplit.megatron_layout import check, format_layout, parse
from autosplit.plan_export import TORCHTITAN_LLAMA3, TRANSFORMERS_LLAMA, stage_parts

PUBLISHED = [  # (layout, pipeline size, decoder layers, virtual stages per rank): Megatron-Bridge perf recipes
    ("Et*2|(t*2|)*34,t*3|(t*2|)*3,tL", 8, 80, 5),  # Llama-3-70B, TP 4 × PP 8 × VP 5 (llama/h100/llama3.py)
    ("Et|(tt|)*30mL", 8, 61, 4),  # DeepSeek-V3 on H100, PP 8 × VP 4, one multi-token prediction layer
    ("Et*4|(t*4|)*14tmL", 4, 61, 4),  # DeepSeek-V3 on GB300, PP 4 × VP 4
]


def _spacing(layout: str) -> str:
    """A layout up to what Megatron ignores: commas, spaces, and how a letter run is written (``tt`` or ``t*2``)."""
    return re.sub(r"([A-Za-z])\*(\d+)", lambda m: m[1] * int(m[2]), re.sub(r"[,\s]", "", layout))


@pytest.mark.parametrize(("layout", "pp", "layers", "vp"), PUBLISHED)
def test_published_layouts_parse_check_and_come_back_as_written(layout, pp, layers, vp):
    stages = parse(layout)
    assert len(stages) == pp * vp and check(stages, num_layers=layers, pipeline=pp, mtp_layers=stages[-1].count("m")) == vp
    assert parse(format_layout(stages)) == stages and _spacing(format_layout(stages)) == _spacing(layout)
    if layout.startswith("Et*2|"):
        assert format_layout(stages) == layout  # written in the recipe's own style, character for character
        assert stages[0] == ("E", "t", "t") and stages[35] == ("t", "t", "t") and stages[-1] == ("t", "L")


@pytest.mark.parametrize(("layout", "words"), [
    ("Et*2|(t*2|)*34,t*3|(t*2|)*3,t", "loss L must come once, last"),
    ("t*2|(t*2|)*38,tL", "embedding E must come once, first"),
    ("Et*2|(t*2|)*34,t*3|(t*2|)*3,ttL", "81 transformer layers"),
    ("Et*2|(t*2|)*35,tL", "do not divide over pipeline size 8"),
    ("Et*2|x*3|L", "no layer letters"),
    ("((t)*2)*2", "no layer letters"),
    ("", "is empty"),
    ("Et*2|(t*2|)*34, t*3|(t*2|)*3,tL", "no spaces"),
])
def test_layouts_megatron_refuses_are_refused_naming_the_rule(layout, words):
    with pytest.raises(ConstraintError, match=re.escape(words)):
        check(parse(layout), num_layers=80, pipeline=8)


def _llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=16, attn_implementation="eager")
    return LlamaForCausalLM(LlamaConfig(**shape)), (torch.randint(0, 128, (8, 8)),)


def _same(a: autosplit.Plan, b: autosplit.Plan) -> None:
    assert stage_parts(a, TRANSFORMERS_LLAMA) == stage_parts(b, TRANSFORMERS_LLAMA)
    def run(p: autosplit.Plan) -> tuple:
        return p.schedule, p.stages_per_rank, p.micro_batches, p.mesh, p.batch

    assert run(a) == run(b)


def test_a_plan_exported_to_either_engine_reads_back_as_the_same_plan(tmp_path):
    """autosplit's own plan of a 2-layer Llama (its layers kept whole, as both engines place them), and an interleaved
    one of a 4-layer Llama (two stages per rank), written as Megatron flags and as torchtitan TOML and Python, and read back."""
    model, args = _llama(2)
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args, micro_batches=2, schedule="1f1b", expressible_in="megatron")
    solved = planner.plan()
    model4, args4 = _llama(4)
    looped = autosplit.Planner(model4, ["cpu"] * 2, example_inputs=args4, micro_batches=4, schedule="interleaved1f1b",
                               stages_per_rank=2)
    interleaved = looped.manual("megatron:Et|t|t|tL")
    assert stage_parts(interleaved, TRANSFORMERS_LLAMA) == (("tok_embeddings", "layers.0"), ("layers.1",), ("layers.2",),
                                                            ("layers.3", "norm", "output"))
    for plan, source in ((solved, planner), (interleaved, looped)):
        flags = plan.export("megatron")
        assert "--pipeline-model-parallel-size 2" in flags and "--micro-batch-size" in flags
        _same(plan, source.manual("megatron:" + flags))
        toml = plan.export("torchtitan")
        config = tomllib.loads(toml)
        fqns = [f for stage in config["parallelism"]["module_fqns_per_model_part"] for f in stage]
        assert all(f in ("tok_embeddings", "norm", "output") or re.fullmatch(r"layers\.\d+", f) for f in fqns)
        assert config["parallelism"]["pipeline_parallel_schedule"] == {"1f1b": "1F1B", "interleaved1f1b": "Interleaved1F1B"}[plan.schedule]
        (tmp_path / "job.toml").write_text(toml)
        _same(plan, source.manual(f"torchtitan:{tmp_path / 'job.toml'}"))
        _same(plan, source.manual(config))  # the same tables as a mapping
        python = plan.export("torchtitan", form="python")
        assert "config.parallelism.pipeline_parallel_microbatch_size" in python and "'lm_head'" in python and "torchtitan 0.3" in python
        compile(python, "exported", "exec")


@pytest.mark.parametrize(("name", "devices", "layout"), [
    ("llama3-8b", 4, "Et*4|(t*4|)*6,t*4L"),
    ("llama3-70b", 8, "Et*2|(t*2|)*34,t*3|(t*2|)*3,tL"),  # Megatron-Bridge's own, 40 stages
])
def test_the_8b_and_70b_shapes_on_the_meta_device_round_trip_through_megatron_and_torchtitan(name, devices, layout, tmp_path):
    from benchmarks.plan_llms import _model

    planner = autosplit.Planner(_model(name), ["H100-80GB"] * devices, example_inputs=(autosplit.Spec((16, 8192), torch.long),),
                                precision="fp32", schedule="interleaved1f1b", micro_batches=16,  # torchtitan: no bf16 without FSDP
                                stages_per_rank=len(parse(layout)) // devices)
    plan = planner.manual(f"megatron:{layout}", check_memory=False)
    flags = plan.export("megatron")
    assert f"--pipeline-model-parallel-layout '{layout}'" in flags and "--micro-batch-size 1" in flags
    (tmp_path / "job.toml").write_text(plan.export("torchtitan"))
    for back in (planner.manual("megatron:" + flags, check_memory=False), planner.manual(f"torchtitan:{tmp_path / 'job.toml'}",
                                                                                          check_memory=False)):
        _same(plan, back)
        assert back.step_time == pytest.approx(plan.step_time)


def test_what_an_engine_cannot_express_is_refused_by_name():
    model, args = _llama(2)
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args, micro_batches=2, schedule="1f1b")
    inside = planner.manual([["model.embed_tokens", "model.layers.0.input_layernorm", "model.layers.0.self_attn"],  # a cut inside layer 0
                             ["model.layers.0.post_attention_layernorm", "model.layers.0.mlp", "model.layers.1", "model.norm", "lm_head"]])
    with pytest.raises(ExportError, match=r"cuts inside 'model.layers.0'.*expressible_in=.*together=\[\['model.layers.0'\]\]"):
        inside.export("torchtitan")
    gpipe = planner.with_options(schedule="gpipe").manual([["model.embed_tokens", "model.layers.0"],
                                                           ["model.layers.1", "model.norm", "lm_head"]])
    with pytest.raises(ExportError, match="megatron does not run the 'gpipe' schedule"):
        gpipe.export("megatron")
    assert "GPipe" in gpipe.export("torchtitan")
    with pytest.raises(ExportError, match=r"precision='bf16-mixed' on dp_shard 1, tp 1, pp 2.*autocast only under DDP"):
        planner.with_options(precision="bf16-mixed").manual([["model.embed_tokens", "model.layers.0"],
                                                             ["model.layers.1", "model.norm", "lm_head"]]).export("torchtitan")
    from tests.layouts import gpt_case

    gpt, gpt_args, *_ = gpt_case()
    plan = autosplit.plan(gpt, ["cpu"] * 2, example_inputs=gpt_args, micro_batches=2, schedule="1f1b")
    with pytest.raises(ExportError, match="not named as a transformers Llama"):
        plan.export("megatron")
    with pytest.raises(ExportError, match=r"\['wpe.weight'\] …\) are in none"):  # the learned positions: no llama3 module holds them
        plan.export("torchtitan", names={"tok_embeddings": "wte", "layers": "blocks", "norm": "ln_f", "output": "head"})
    with pytest.raises(ExportError, match="no exporter for engine 'deepspeed'"):
        plan.export("deepspeed")
    assert TORCHTITAN_LLAMA3.model_path("layers.3") == "layers.3" and TRANSFORMERS_LLAMA.model_path("layers.3") == "model.layers.3"


def llama_workload(batch: int = 8) -> dict:
    """A 2-layer transformers Llama for the command line (``tests.test_engines:llama_workload``)."""
    model, args = _llama(2)
    return {"model": model, "example_inputs": args, "example_kwargs": {}}


def test_the_command_line_exports_a_plan_and_compares_the_engines_configurations(tmp_path, capsys):
    from autosplit.cli import main

    flags, toml = tmp_path / "megatron.txt", tmp_path / "job.toml"
    common = ["tests.test_engines:llama_workload", "--devices", "cpu*2", "--schedule", "1f1b", "--micro-batches", "2"]
    assert main(["plan", *common, "--export", "megatron", "--out", str(flags)]) == 0
    printed = capsys.readouterr().out
    assert printed == flags.read_text() and "--pipeline-model-parallel-layout 'Et|tL'" in printed
    assert main(["plan", *common, "--export", "torchtitan", "--out", str(toml)]) == 0
    assert tomllib.loads(toml.read_text())["parallelism"]["module_fqns_per_model_part"] == [["tok_embeddings", "layers.0"],
                                                                                           ["layers.1", "norm", "output"]]
    capsys.readouterr()
    assert main(["compare", *common, "--manual", "megatron:Et|tL", "--manual", f"torchtitan:{toml}", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["candidates"]
    assert [r["name"] for r in rows] == ["autosplit", "megatron", "torchtitan"] and all(r["feasible"] for r in rows)
    assert rows[1]["plan"]["step_time"] == pytest.approx(rows[2]["plan"]["step_time"])


def test_expressible_in_plans_only_what_the_engine_runs_and_says_what_that_costs():
    """One wide Llama layer on two devices: the best split cuts inside it (attention | MLP), which no
    engine can write; planned expressible in Megatron, the layer stays whole, the plan exports, and
    the report gives the free plan's step beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from autosplit.report.text import plan_report

    torch.manual_seed(0)
    shape: dict[str, Any] = dict(vocab_size=64, hidden_size=64, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
    model, tokens = LlamaForCausalLM(LlamaConfig(**shape)), torch.randint(0, 64, (8, 64))
    planner = autosplit.Planner(model, ["A100-80GB"] * 2, example_inputs=(tokens,), schedule="1f1b", micro_batches=4)
    free = planner.plan()
    with pytest.raises(ExportError, match=re.escape("cuts inside 'model.layers.0'")):
        free.export("megatron")
    with pytest.raises(LayerCutError, match=r"the nearest plan that keeps every layer whole .* predicted step") as cut:
        planner.export("megatron", free)
    nearest = cut.value.nearest
    assert isinstance(nearest, autosplit.Plan) and nearest.step_time > free.step_time
    assert "--pipeline-model-parallel-layout" in nearest.export("megatron")
    whole = planner.with_options(expressible_in="megatron").plan()
    assert "--pipeline-model-parallel-layout" in whole.export("megatron") and "tok_embeddings" in whole.export("torchtitan")
    assert whole.engine_gap == ("megatron", pytest.approx(free.step_time)) and whole.step_time > free.step_time
    assert "planned as megatron runs it (whole layers)" in plan_report(whole)
    with pytest.raises(ConstraintError, match="expressible_in"):
        planner.with_options(expressible_in="deepspeed")


def test_a_bare_layout_takes_as_many_pipeline_ranks_as_its_stages_and_the_devices_allow():
    """Megatron-Bridge's 70B layout has 40 stages: on 64 devices at tp 4 that is pp 8 × vp 5 and
    data-parallel 2, as the recipe runs; here, 2 stages on 4 devices: pp 2, two copies. Megatron's
    flags give micro-batches as sizes: global 8 rows, 1 per micro-batch, over 2 copies is 4 each."""
    model, args = _llama(2)
    planner = autosplit.Planner(model, ["cpu"] * 4, example_inputs=args)
    bare = planner.manual("megatron:Et|tL")
    assert bare.mesh == {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "tp": 1} and bare.schedule == "1f1b"
    flagged = planner.manual("megatron:--pipeline-model-parallel-layout 'Et|tL' --micro-batch-size 1 --global-batch-size 8")
    assert flagged.micro_batches == 4 and flagged.mesh == bare.mesh
    parallelism = tomllib.loads(flagged.export("torchtitan"))["parallelism"]
    assert (parallelism["data_parallel_replicate_degree"], parallelism["pipeline_parallel_degree"]) == (2, 2)
    assert parallelism["pipeline_parallel_microbatch_size"] == 1
    _same(flagged, planner.manual("megatron:" + flagged.export("megatron")))


def _imported_trains_like_the_model(rank: int, world: int) -> None:
    """A Megatron layout and its flags read as a plan, run by ``distribute`` on 2 gloo processes in
    float64: the loss at every step and every gradient equal the unsplit model's on the same batch."""
    import copy

    from tests.helpers import full_tensor, where
    from tests.layouts import llama_case, reference_step

    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = llama_case()
    model = model.double()
    reference = copy.deepcopy(model)
    plan = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args).manual(
        "megatron:--pipeline-model-parallel-layout 'Et|tL' --micro-batch-size 2 --global-batch-size 8")
    assert plan.micro_batches == 4 and plan.schedule == "1f1b"
    pipe = autosplit.distribute(model, None, example_inputs=args, loss_fn=loss_fn, plan=plan)
    opt, ref_opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters())
    for step in range(2):
        loss = pipe.step(*args, target=target)
        (expected,) = reference_step(reference, args, kwargs, target, loss_fn, copies=1)
        if pipe.is_last:
            torch.testing.assert_close(loss, expected, msg=where(f"step {step} loss"))
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(full_tensor(p.grad), ref_params[name].grad, msg=where(f"rank {rank} step {step} grad {name}"))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def test_an_imported_megatron_layout_trains_as_the_unsplit_model_under_distribute(gloo):
    gloo(2).run(_imported_trains_like_the_model, [()])


@pytest.mark.parametrize("family", ["Qwen2", "Mistral"])
def test_qwen_and_mistral_are_read_under_the_transformers_llama_names(family):
    import transformers

    torch.manual_seed(0)
    shape: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=16)
    model = getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(**shape))
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=(torch.randint(0, 128, (8, 8)),), schedule="1f1b",
                                micro_batches=2, expressible_in="torchtitan")
    plan = planner.plan()
    fqns = tomllib.loads(plan.export("torchtitan"))["parallelism"]["module_fqns_per_model_part"]
    assert [f for stage in fqns for f in stage] == ["tok_embeddings", "layers.0", "layers.1", "norm", "output"]
    _same(plan, planner.manual("megatron:" + plan.export("megatron")))


def test_without_a_pipeline_the_micro_batches_are_torchtitans_gradient_accumulation(tmp_path):
    model, args = _llama(2)
    plan = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args, data_parallel=2, replicate="fully_shard", micro_batches=2).plan()
    assert plan.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 1} and plan.micro_batches == 2
    config = tomllib.loads(plan.export("torchtitan"))
    assert config["training"] == {"local_batch_size": 2, "global_batch_size": 8,  # 8 rows / (2 per step · 2 copies): 2 steps
                                  "mixed_precision_param": "float32"}
    (tmp_path / "job.toml").write_text(plan.export("torchtitan"))
    mesh = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args)  # a recipe's devices are the whole mesh
    _same(plan, mesh.manual(f"torchtitan:{tmp_path / 'job.toml'}"))
    flags = plan.export("megatron")  # sharded: Megatron-FSDP over parameters, gradients and optimizer state, as fully_shard
    assert "--use-megatron-fsdp \\\n  --data-parallel-sharding-strategy optim_grads_params" in flags and "'Et*2L'" in flags
    _same(plan, mesh.manual("megatron:" + flags))


def test_megatrons_distributed_optimizer_is_fully_shard_under_a_pipeline_else_its_state_whole_and_said(caplog):
    model, args = _llama(2)
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args)
    with caplog.at_level("WARNING", logger="autosplit.compiler.engine_plans"):
        plan = planner.manual("megatron:--pipeline-model-parallel-size 1 --pipeline-model-parallel-layout EttL --use-distributed-optimizer")
    assert plan.mesh == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "tp": 1} and "upper bound" in caplog.text
    # under a pipeline, FSDP2 shards each stage as the distributed optimizer does: gathered for the step, reduced once
    piped = autosplit.Planner(model, ["cpu"] * 4, example_inputs=args).manual(
        "megatron:--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et|tL' --use-distributed-optimizer")
    assert piped.mesh == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1}
    with pytest.raises(ConstraintError, match="optim_grads_params"):
        planner.manual("megatron:--pipeline-model-parallel-layout EttL --use-megatron-fsdp --data-parallel-sharding-strategy optim")


def test_a_configuration_that_would_leave_a_layer_out_is_refused():
    """Megatron refuses a layout whose ``t`` count is not the model's layers; torchtitan keeps only the
    modules its lists name, so lists that leave one out would train without it: both are refused."""
    model, args = _llama(2)
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args)
    with pytest.raises(ConstraintError, match="it holds 1 transformer layers t, the model 2"):
        planner.manual("megatron:Et|L")
    with pytest.raises(ConstraintError, match="do not split as a shell would"):
        planner.manual("megatron:--pipeline-model-parallel-layout 'Et|tL")
    lists = [["tok_embeddings", "layers.0"], ["norm", "output"]]
    with pytest.raises(ConstraintError, match=re.escape("leaves out ['layers.1']")):
        planner.manual({"parallelism": {"pipeline_parallel_degree": 2, "module_fqns_per_model_part": lists}})


def test_a_torchtitan_config_is_read_in_the_precision_torchtitan_trains_it_in():
    """torchtitan casts with FSDP2's policy where it shards (its default mixed_precision_param is bfloat16),
    with autocast under DDP alone, and not at all with pp and no FSDP (``maybe_enable_amp``)."""
    model, args = _llama(2)
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args, micro_batches=2, schedule="1f1b")
    stages = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    read = {
        "bf16-fsdp": {"parallelism": {"data_parallel_shard_degree": 2}},
        "bf16-mixed": {"parallelism": {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1}},
        "fp32": {"parallelism": {"data_parallel_shard_degree": 1, "pipeline_parallel_degree": 2,
                                 "module_fqns_per_model_part": stages}},
    }
    for precision, config in read.items():
        assert planner.manual(config, check_memory=False).precision == precision, config
    with pytest.raises(ConstraintError, match="mixed_precision_param 'float16'"):
        planner.manual({"parallelism": {"data_parallel_shard_degree": 2}, "training": {"mixed_precision_param": "float16"}})


def test_megatrons_tp_comm_overlap_and_torchtitans_async_tp_are_read_as_async_tp():
    model, args = _llama(2)
    planner = autosplit.Planner(model, ["cpu"] * 2, example_inputs=args)
    overlapped = planner.manual("megatron:--tensor-model-parallel-size 2 --pipeline-model-parallel-layout EttL --tp-comm-overlap")
    plain = planner.manual("megatron:--tensor-model-parallel-size 2 --pipeline-model-parallel-layout EttL")
    assert overlapped.async_tp and not plain.async_tp and overlapped.tensor_parallel == 2
    titan = planner.manual({"parallelism": {"tensor_parallel_degree": 2, "enable_async_tensor_parallel": True}})
    assert titan.async_tp and titan.tensor_parallel == 2
    # the CPU has no engine profile: nothing is hidden, so the costs are the same
    assert overlapped.step_time == pytest.approx(plain.step_time)


def test_megatrons_fp8_flags_are_read_as_float8():
    model, args = _llama(2)
    planner = autosplit.Planner(model, autosplit.Cluster.of("B200", 2, engine="megatron-te"), example_inputs=args, precision="bf16-mixed")
    base = "megatron:--tensor-model-parallel-size 2 --pipeline-model-parallel-layout EttL --bf16"
    assert planner.manual(f"{base} --fp8-format hybrid", check_memory=False).float8 == "tensorwise"  # Megatron's delayed default
    assert planner.manual(f"{base} --fp8-format e4m3 --fp8-recipe mxfp8", check_memory=False).float8 == "mxfp8"
    assert planner.manual(base, check_memory=False).float8 is None
    with pytest.raises(ConstraintError, match="--fp8-recipe blockwise is not costed"):
        planner.manual(f"{base} --fp8-format e4m3 --fp8-recipe blockwise", check_memory=False)

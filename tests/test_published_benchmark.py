"""The published-runs benchmark's reader (``benchmarks/published.py``): every row of the record classified, a
malformed row named with what is wrong while the others are read on, nothing costed here."""

from __future__ import annotations

import csv
from pathlib import Path

from benchmarks.published import DEFAULT_CSV
from benchmarks.published_rows import read_csv


def _rows() -> tuple[list[str], dict[str, dict[str, str]]]:
    with DEFAULT_CSV.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), {row["row_id"]: row for row in reader}


def test_every_row_of_the_record_is_classified_and_the_expressible_ones_become_recipes():
    read = read_csv(DEFAULT_CSV, None)
    assert len(read) == len(_rows()[1])
    by_id = {c.row_id: c for c in read}
    assert by_id["294"].spec is not None and by_id["294"].spec["dp"] == 8 and by_id["294"].spec["micro_batches"] == 1
    # a mixture of experts the record knows the configuration of is built whole, with its ep; one it does not, refused
    deepseek, automodel = by_id["2"].spec, by_id["401"].spec
    assert deepseek is not None
    assert (deepseek["ep"], deepseek["shape"]["family"], deepseek["shape"]["num_layers"]) == (64, "deepseek_v3", 61)
    assert automodel is not None and (automodel["ep"], automodel["checkpointing"]) == (8, "full")  # AutoModel's MoE configs recompute
    gpt_oss = by_id["78"].spec
    assert gpt_oss is not None and (gpt_oss["shape"]["family"], gpt_oss["ep"], gpt_oss["pp"]) == ("gpt_oss", 8, 4)
    assert "ep unknown" in by_id["403"].reasons  # AutoModel's GPT-OSS rows do not say their expert layout
    fp8, mx, nvfp4 = by_id["50"].spec, by_id["49"].spec, by_id["17"]
    assert fp8 is not None and (fp8["float8"], fp8["engine"], fp8["async_tp"], fp8["gpu"]) == ("tensorwise", "megatron-te", True, "H100")
    assert mx is not None and (mx["float8"], mx["async_tp"]) == ("mxfp8", False) and nvfp4.reasons == ["nvfp4"]
    titan = by_id["305"].spec
    assert titan is not None and (titan["engine"], titan["async_tp"], by_id["304"].spec["async_tp"]) == ("torch-compile", True, False)
    assert by_id["294"].spec["gpu"] == "H100-500W" and by_id["2"].info["gpu"] == "GB200"  # torchtitan's 500 W H100s apart
    # torchtitan's pipelined 405B at 262K gives no micro batch: its default, one micro-batch per stage (8 of 1 row)
    long = by_id["311"].spec
    assert long is not None and (long["pp"], long["cp"], long["micro_batch"], long["micro_batches"]) == (8, 8, 1, 8)
    assert all(c.reasons or c.spec is not None for c in read)  # a row is costed or says why not
    # Megatron-Core's data parallelism: its distributed optimizer where the row is silent (NeMo's row 412), Megatron-FSDP
    # where the row says FSDP (269); an empty recompute cell is costed as none, but known to be unstated
    nemo, megatron_fsdp = by_id["412"].spec, by_id["269"].spec
    assert nemo is not None and (nemo["replicate"], nemo["engine"], nemo["recompute_stated"]) == ("fully_shard", "megatron-te", False)
    assert megatron_fsdp is not None and (megatron_fsdp["replicate"], megatron_fsdp["engine"]) == ("fully_shard", "megatron-fsdp")


def test_malformed_rows_are_named_and_the_run_goes_on(tmp_path: Path):
    fields, rows = _rows()
    good = rows["294"]
    bad = [{**good, "row_id": "9001", "num_gpus": "eight"}, {**good, "row_id": "9002", "tp": "3"},
           {**good, "row_id": "9003", "global_batch_size": "20"}, {**good, "row_id": "9004", "dp": "2"},
           {**good, "row_id": "9005", "tokens_per_sec_per_gpu": "fast"},
           {**rows["311"], "row_id": "9007", "global_batch_size": "12"}]
    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows([good, *bad])
    with path.open("a") as f:
        f.write("9006,too,few\n")
    read = {c.row_id: c for c in read_csv(path, None)}
    assert read["294"].spec is not None
    messages = {i: read[i].message for i in ("9001", "9002", "9003", "9004", "9005", "9007")}
    assert all("malformed" == read[i].reasons[0] for i in messages)
    assert "num_gpus='eight' is not a number" in messages["9001"] and "not a multiple of TP 3" in messages["9002"]
    assert "global batch 20" in messages["9003"] and "dp 2 given" in messages["9004"] and "'fast'" in messages["9005"]
    assert "torchtitan's default 8 micro-batches" in messages["9007"]  # no micro batch given, and the default does not split
    assert read["9006"].reasons == ["malformed"] and "fewer cells than the header" in read["9006"].message


def test_a_model_named_without_its_shape_is_built_as_published():
    """Rows that name a model without its shape take the shape it was published with; the families' MLPs, norms and
    biases are the published ones (a GELU or squared-ReLU MLP has two matrices, a gated one three)."""
    import torch

    from benchmarks.published_models import build, published_shape

    by_id = {c.row_id: c for c in read_csv(DEFAULT_CSV, None)}
    llama2, gpt3, nemotron = (by_id[i].spec for i in ("344", "343", "424"))
    assert llama2 is not None and llama2["shape"]["hidden_size"] == 4096 and llama2["shape"]["family"] == "llama"
    assert gpt3 is not None and gpt3["shape"]["family"] == "gpt3" and by_id["343"].info["shape_from"] == "published shapes"
    assert nemotron is not None and nemotron["shape"]["num_kv_heads"] == 8 and by_id["294"].info["shape_from"] == "row"
    assert published_shape("gpt-7.1b") is None and "model shape unknown" in by_id["329"].reasons
    tiny = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=128, vocab_size=96)

    def linears(model: torch.nn.Module) -> dict[str, bool]:
        return {n.split(".")[-1]: m.bias is not None for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}

    llama, gpt, relu2 = (build({**tiny, "family": f}, 32) for f in ("llama", "gpt3", "nemotron"))
    assert set(linears(llama)) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
    assert set(linears(gpt)) == set(linears(relu2)) == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "lm_head"}
    assert linears(gpt)["up_proj"] and not linears(relu2)["up_proj"] and not linears(gpt)["lm_head"]
    assert gpt.lm_head.weight is gpt.model.embed_tokens.weight  # tied, but not across pipeline stages
    untied = build({**tiny, "family": "gpt3"}, 32, pipelined=True)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert type(gpt.model.layers[0].mlp.act_fn).__name__ == "GELUActivation"
    assert type(relu2.model.layers[0].mlp.act_fn).__name__ == "ReLUSquaredActivation"


def test_a_sliding_window_is_attended_as_transformers_defines_it_and_counted_as_a_kernel_runs_it():
    """GPT-OSS's sliding layers in the stand-ins: the output of a sliding-window causal mask (float64, GQA, a sequence
    not a multiple of the window), and about ``2·window`` score pairs a query counted, not the sequence a mask costs."""
    import torch
    import torch.nn.functional as F

    from benchmarks.published_models import sliding_attention

    g = torch.Generator().manual_seed(0)
    for seq, window in ((13, 4), (16, 4), (9, 8)):
        q, k, v = (torch.randn(2, heads, seq, 8, dtype=torch.float64, generator=g) for heads in (4, 2, 2))
        i = torch.arange(seq)
        band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(sliding_attention(q, k, v, window), expected, rtol=0, atol=1e-12)
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = (torch.randn(1, 4, 256, 16, device="meta") for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        sliding_attention(q, k, v, 16)
    pairs = counter.get_total_flops() / (4 * 4 * 16)  # two matmuls of 2·d FLOPs per score pair and head
    assert 256 * 16 <= pairs <= 256 * 2 * 16 < 256 * 256 / 4


def test_the_fit_recovers_a_planted_efficiency_and_overlap():
    """Rows whose predictions scale with the GEMM efficiency, exact at 0.7 for one engine and 0.55 for another,
    and (the async-TP rows) exact at tp_overlap 0.5: the fit finds those, and the errors there are zero."""
    from benchmarks.published_fit import fit

    def row(engine: str, exact: float, published: float, async_tp: bool = False) -> dict:
        grid = {}
        for e in (0.5, 0.6, 0.7, 0.8):
            for o in (0.0, 0.5, 1.0):
                off = abs(o - 0.5) if async_tp else 0.0
                for m in (0.6, 0.9):
                    grid[f"efficiency={e:g} memory_efficiency={m:g} tp_overlap={o:g}"] = published * e / exact * (1 - off / 4)
        return {"device": f"GPU ({engine})", "grid": grid, "published_tokens_per_s_per_gpu": published, "async_tp": async_tp}

    rows = [row("megatron-te", 0.7, p, async_tp=i % 2 == 0) for i, p in enumerate((1000.0, 3000.0, 800.0))]
    rows += [row("torch-eager", 0.55, p) for p in (5000.0, 6000.0)]
    best = fit(rows)
    assert best["engines"]["megatron-te"]["efficiency"] == 0.7 and best["engines"]["megatron-te"]["tp_overlap"] == 0.5
    assert best["engines"]["torch-eager"]["efficiency"] == 0.55 and best["engines"]["torch-eager"]["tp_overlap"] == 0.0
    assert best["worst"] < 1e-9 and best["within_10pct"] == 5


def test_plan_3d_replaces_the_rows_it_plans_and_keeps_the_others():
    from benchmarks.plan_3d import _summary, merged

    kept = [{"kind": "megatron-70b:recipe", "outcome": "planned", "tokens_per_s_per_gpu": 1472.0, "published": 1602.0, "fits": True},
            {"kind": "megatron-70b:autosplit", "outcome": "planned", "tokens_per_s_per_gpu": 1221.0}]
    planned = [{"kind": "megatron-70b:autosplit", "outcome": "planned", "tokens_per_s_per_gpu": 1605.0}]
    rows = merged(kept, planned)
    assert [r["kind"] for r in rows] == ["megatron-70b:recipe", "megatron-70b:autosplit"]
    assert rows[1]["tokens_per_s_per_gpu"] == 1605.0
    costed = merged([{"row_id": "1", "ratio": 1.0}, {"row_id": "2"}], [{"row_id": "2", "ratio": 1.3}, {"row_id": "3"}], key="row_id")
    assert costed == [{"row_id": "1", "ratio": 1.0}, {"row_id": "2", "ratio": 1.3}, {"row_id": "3"}]  # published.py --into
    summary = _summary({r["kind"]: r for r in rows})
    assert round(summary["megatron-70b:autosplit_over_megatron-70b:recipe"], 3) == round(1605 / 1472, 3)


def test_each_layout_group_is_judged_on_its_best_published_layout(tmp_path: Path):
    from benchmarks.published_groups import best_rows

    fields, rows = _rows()
    faster = {**rows["314"], "row_id": "9001", "tokens_per_sec_per_gpu": "900.5", "tp": "4", "dp": "64", "micro_batch_size": "8"}
    unexpressible = {**rows["314"], "row_id": "9002", "tokens_per_sec_per_gpu": "5000", "cp": "2"}
    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows([rows["314"], faster, unexpressible, rows["316"], rows["294"]])
    best = best_rows(read_csv(path, None))
    assert {g: c.row_id for g, c in best.items()} == {"S03": "9001", "S04": "316"}  # 294 is in no S group; 9002 has CP
    assert best["S03"].spec is not None and best["S03"].spec["tp"] == 4
    assert set(best_rows(read_csv(path, None), {"S04"})) == {"S04"}

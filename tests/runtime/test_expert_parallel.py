"""Expert parallelism trains like the unsplit model (gloo, float64; the table's harness, :func:`tests.layouts.trained_layout`).

A tiny Qwen3-MoE and a tiny DeepSeek-V3 (``tests/moe_cases.py``: 4 experts, top 2; DeepSeek-V3's first layer dense, a
shared expert beside the routed ones) with their experts spread over ep 2 of dp_shard 2, alone and under a pipeline of two
stages: every step's loss (with the router's load-balancing loss, computed on each copy's own tokens, as the reference
computes it copy by copy), every gradient, the clipped global norm, and the parameters after 3 AdamW steps against the
unsplit model. Each rank holds half of each layer's experts, as a DTensor sharded along the expert dimension; a
checkpoint saved so loads with the experts whole (under FSDP2 alone) and into the unsplit model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers import full_tensor, where
from tests.layouts import Comparison, trained_layout

pytest.importorskip("transformers")

EP = {"data_parallel": 2, "replicate": "fully_shard", "expert_parallel": 2}


def _spread(pipe) -> list[tuple[str, Any]]:
    from autosplit.runtime.experts import ExpertParallel

    return [(f"{path}.{name}", p) for module in pipe.stage_modules.values() for path, m in module.named_modules()
            if isinstance(m, ExpertParallel) for name, p in m.named_parameters()]


def _ep_case(model: str, layout: dict, folder: str | None, *, rank: int, world: int) -> None:
    # the router's loss is a statistic of each forward call's tokens: the reference runs micro-batch by micro-batch too
    comparison = Comparison(chunks=layout["micro_batches"], clip=1.0)
    pipe, reference = trained_layout(model, {**EP, **layout}, comparison, rank=rank, world=world)
    spread = _spread(pipe)
    assert spread and pipe.plan.expert_parallel == 2, "the experts of every MoE layer this rank runs are spread"
    efsdp = pipe.plan.dp_shard // 2
    for name, p in spread:
        if efsdp > 1:  # the ep group's 2 experts here sharded again over the efsdp groups by their FSDP2 unit
            sharded = p.placements[1].is_shard(0) and not (p.placements[0].is_replicate() or p.placements[0].is_partial())
            assert p.device_mesh.mesh_dim_names == ("efsdp", "ep") and sharded, (name, p.placements)  # (_StridedShard, Shard)
            assert p.to_local().shape[0] == 2 // efsdp and p.shape[0] == 4, f"{name}: 1 of the 4 experts here"
            continue
        assert p.device_mesh.mesh_dim_names == ("dp_shard",) and p.placements[0].is_shard(0), name
        assert p.to_local().shape[0] == 2 and p.shape[0] == 4, f"{name}: 2 of the 4 experts here"
        local = full_tensor(p)[pipe.layout.replica * 2:(pipe.layout.replica + 1) * 2]
        torch.testing.assert_close(p.to_local(), local, msg=where(f"{name}: this rank's experts are its share"))
    if folder is not None:
        pipe.save(f"{folder}/ckpt")
        if rank == 0:
            torch.save(reference.state_dict(), f"{folder}/reference.pt")
    pipe.close()


def _resume_case(model: str, folder: str, *, rank: int, world: int) -> None:
    """The checkpoint saved under ep 2 loads under dp_shard 2 alone (every expert on both ranks, sharded by FSDP2)
    and into the unsplit model, each equal to the unsplit model trained beside it."""
    import autosplit
    from autosplit.runtime.checkpoint import load_checkpoint
    from tests.layouts import MODELS

    torch.manual_seed(5)  # other weights: everything comes from the checkpoint
    net, args, _, _, loss_fn = MODELS[model]()
    net = net.double()
    pipe = autosplit.distribute(net, ["cpu"] * world, example_inputs=args, loss_fn=loss_fn, data_parallel=2, replicate="fully_shard",
                                schedule="gpipe", micro_batches=1, time_limit=2)
    assert not _spread(pipe)
    pipe.load(f"{folder}/ckpt")
    unsplit = MODELS[model]()[0].double()
    load_checkpoint(f"{folder}/ckpt", unsplit)
    trained = torch.load(f"{folder}/reference.pt")
    for name, value in unsplit.state_dict().items():
        torch.testing.assert_close(value, trained[name], msg=where(f"{name} in the unsplit model"))
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(full_tensor(p), trained[name], msg=where(f"{name} resumed under dp_shard 2 alone"))
    pipe.close()


def test_ep2_under_fully_shard2_trains_like_the_unsplit_model_and_its_checkpoint_loads_elsewhere(gloo, tmp_path):
    gloo(2).run(_ep_case, [("qwen3_moe", {"schedule": "gpipe", "micro_batches": 1}, str(tmp_path)),
                           ("deepseek_v3", {"schedule": "gpipe", "micro_batches": 2}, None)])
    gloo(2).run(_resume_case, [("qwen3_moe", str(tmp_path))])


def test_ep2_of_dp_shard4_shards_the_experts_over_efsdp2_and_trains_like_the_unsplit_model(gloo, tmp_path):
    """torchtitan's layout: the experts' ranks borrowed from dp_shard 4 as efsdp 2 × ep 2, each expert's state sharded
    over the two ep groups that hold it; its checkpoint loads under dp_shard 2 alone and into
    the unsplit model."""
    gloo(4).run(_ep_case, [("qwen3_moe", {"data_parallel": 4, "schedule": "gpipe", "micro_batches": 1}, str(tmp_path))])
    gloo(2).run(_resume_case, [("qwen3_moe", str(tmp_path))])


@pytest.mark.smoke  # the fast tier's case of this runtime path
def test_ep2_by_pp2_trains_like_the_unsplit_model(gloo):
    gloo(4).run(_ep_case, [("qwen3_moe", {"schedule": "1f1b", "micro_batches": 2}, None)])

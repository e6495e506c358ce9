"""The hybrid planner's choice, run: 2 workers × 2 stages on 4 gloo processes train like the
unsplit model."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.distributed as dist

import autosplit
from autosplit.api.hybrid import plan_hybrid
from autosplit.compiler.hybrid import Cluster
from tests.helpers import gpt_case
from tests.layouts import Comparison, train_alike


def _cpu_cluster() -> Cluster:
    cpu = dataclasses.replace(autosplit.devices.PRESETS["cpu"], torch_device="cpu")
    return Cluster("2 × 2 CPU processes", cpu, 2, 2, (cpu.link_bandwidth, cpu.link_latency), 1e9, 1e-4)


def _mesh_case(*, rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, args, kwargs, target, loss_fn = gpt_case()  # a global batch of 8
    model = model.double()
    reference = copy.deepcopy(model)
    box: list[Any] = [None]
    if rank == 0:  # the hybrid planner's choice: 2 workers × 2 stages, each worker 4 of the 8 rows
        box = [plan_hybrid(model, _cpu_cluster(), example_inputs=tuple(a[:4] for a in args),
                           example_kwargs={k: v[:4] for k, v in kwargs.items()}, global_batch=8, replica_sizes=[2],
                           noise_scale=1e3, time_limit=2).choice]
    dist.broadcast_object_list(box, src=0)
    choice = box[0]
    assert (choice.k, choice.replicas, choice.worker_batch) == (2, 2, 4)
    pipe = autosplit.distribute(model, None, example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn,  # the global batch
                                data_parallel=choice.replicas, plan=choice.plan)
    assert pipe.layout.replica == rank % 2
    train_alike(pipe, reference, (args, kwargs, target, loss_fn), Comparison(), f"rank {rank}")


def test_the_chosen_hybrid_trains_like_the_unsplit_model_on_a_2x2_mesh(gloo):
    gloo(4).run(_mesh_case, [()])

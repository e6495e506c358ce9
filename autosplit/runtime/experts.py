"""Expert parallelism run: each MoE layer's experts spread over an ``ep`` group, the tokens exchanged by all-to-all.

A stage's graph runs a layer's experts as the nodes of its experts module (:mod:`autosplit.passes.experts`). On a
plan with ``expert_parallel = ep`` those nodes are replaced by one call of :class:`ExpertParallel`, put at the
experts module's own path, so the state dict keeps the model's names:

- its parameters are the experts' stacked ones as DTensors sharded along the expert dimension over the ``ep``
  group (``Shard(0)``): this rank holds ``E / ep`` whole experts, ``[rank · E/ep, (rank + 1) · E/ep)``;
- its forward is torchtitan's token dispatcher (``AllToAllTokenDispatcher``) around the model's own experts
  module: each (token, choice) pair goes to the rank holding its expert (``all_to_all_single`` of the rows, the
  counts exchanged first), that rank runs the experts module's own forward on what it received — each row one
  choice, of its local expert, weighed 1 — with its local experts (``torch.func.functional_call``, the module
  told it has ``E / ep`` experts), the results come back by the reverse all-to-all, return to the pairs' own
  order, and are weighed and summed per token as the module does (``weighted.view(T, k, h).sum(1)``). The
  order of the tokens in and out is exactly restored; the backward runs the same exchanges reversed
  (:func:`~autosplit.compat.all_to_all_autograd`).

Under data parallelism each expert's gradient gathers the tokens of every rank of its ep group: the sum of those
copies' gradients, which the hook of :class:`ExpertParallel` divides by ``divide``, as FSDP2 averages the dense
gradients. Where ep is the whole dp_shard (``efsdp = 1``), each expert lives on one rank, the stage's FSDP2 unit
leaves it out (:func:`expert_parameters`) and ``divide`` is every copy; where ep is a factor of it, the ``efsdp``
ranks that hold the same experts (one per ep group) shard their state with a ``fully_shard`` unit of their own
(:func:`~autosplit.runtime.placement.replicate_stage`), whose reduction averages their groups' sums: ``divide`` is
then the copies of one group, ``ep``.

Usage::

    rewritten = expert_parallel_stage(stage_module, modules, module_paths, mesh["dp_shard"], divide=dp)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from autosplit.compat import all_to_all_autograd
from autosplit.errors import CodegenError, advice

__all__ = ["ExpertParallel", "expert_modules", "expert_parallel_stage", "expert_parameters"]


class ExpertParallel(torch.nn.Module):
    """One MoE layer's experts over an ``ep`` group (the module docstring)."""

    def __init__(self, experts: torch.nn.Module, params: Mapping[str, torch.Tensor], ep_mesh: Any, count: int, divide: int) -> None:
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        self.local, self.divide = count // ep_mesh.size(), divide
        self.group = ep_mesh.get_group()
        for name, full in params.items():  # every rank holds them whole here: each keeps its share
            self.register_parameter(name, torch.nn.Parameter(distribute_tensor(full.detach(), ep_mesh, [Shard(0)]),
                                                             requires_grad=full.requires_grad))
        kernel = copy.copy(experts)  # the model's experts module, told it holds the local experts; the model untouched
        kernel.__dict__.update(_parameters={n: torch.nn.Parameter(p.detach().to("meta")) for n, p in experts.named_parameters()},
                               _forward_hooks={}, _forward_pre_hooks={}, _modules=dict(experts._modules), num_experts=self.local)
        self._kernel = [kernel]  # apart from the module tree: its parameters are this module's

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        width = hidden.shape[-1]
        chosen = top_k_index.reshape(-1)
        owner = torch.div(chosen, self.local, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)  # the pairs grouped by the rank that holds their expert
        rows, ids = hidden[order // k], (chosen % self.local)[order]
        sent = torch.bincount(owner, minlength=self.group.size())
        counts = torch.empty_like(sent)
        dist.all_to_all_single(counts, sent, group=self.group)
        out_split, in_split = sent.tolist(), counts.tolist()
        got = all_to_all_autograd(rows.contiguous(), in_split, out_split, self.group)
        got_ids = ids.new_empty(sum(in_split))
        dist.all_to_all_single(got_ids, ids.contiguous(), in_split, out_split, group=self.group)
        local = {name: self._local(p) for name, p in self.named_parameters()}
        done = torch.func.functional_call(self._kernel[0], local, (got, got_ids[:, None], got.new_ones(len(got_ids), 1)))
        back = all_to_all_autograd(done.contiguous(), out_split, in_split, self.group)
        pairs = back[torch.argsort(order)]  # each (token, choice) pair in its own place again
        return (pairs * top_k_weights.reshape(-1, 1).to(pairs.dtype)).view(tokens, k, width).sum(dim=1).to(hidden.dtype)

    def _local(self, p: Any) -> torch.Tensor:
        """This rank's experts of ``p`` (a DTensor), their gradient divided by the copies whose mean the step trains."""
        local = p.to_local()
        if local.requires_grad and self.divide > 1:
            local.register_hook(lambda g: g / self.divide)
        return local


def expert_modules(module: torch.nn.Module) -> list[ExpertParallel]:
    """Every :class:`ExpertParallel` inside ``module``."""
    return [m for m in module.modules() if isinstance(m, ExpertParallel)]


def expert_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of every :class:`ExpertParallel` inside ``module``: the stage's FSDP2 unit leaves them out."""
    return [p for m in expert_modules(module) for p in m.parameters()]


def expert_parallel_stage(
    stage: fx.GraphModule, experts: Mapping[str, tuple[torch.nn.Module, int]], module_paths: Mapping[str, str], ep_mesh: Any,
    *, divide: int,
) -> list[str]:
    """Replace, in ``stage``, each experts module of ``experts`` (path → (the model's module, its E)) the stage runs
    by an :class:`ExpertParallel` at its path; ``module_paths``: the capture's node name → module path. Returns
    the paths replaced. Refuses a region that is not the experts' forward of three inputs and one output."""
    done = []
    for path, (module, count) in experts.items():
        region = [n for n in stage.graph.nodes if _within(module_paths.get(n.name, ""), path) and n.op not in ("placeholder", "output")]
        if not any(n.op != "get_attr" for n in region):
            if region or any(_within(name, path) for name, _ in stage.named_parameters()):  # run in a recomputed region's module
                raise CodegenError(advice(f"the experts at {path!r} run inside a region of the stage, not in its graph",
                                          "expert parallelism replaces the experts' nodes in the stage's own graph, and a "
                                          "recomputed block holds them in a module of its own", "plan with checkpointing='none' "
                                          "(or without recomputing the MoE layers), or with expert_parallel=1"))
            continue
        inside = set(region)
        inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))
        outputs = [n for n in region if any(u not in inside for u in n.users)]
        hidden, index, weights = _roles(inputs, path)
        if len(outputs) != 1:
            raise CodegenError(advice(f"the experts at {path!r} hand {len(outputs)} values to the rest of the stage",
                                      "expert parallelism replaces their forward, which returns one tensor", "plan with expert_parallel=1"))
        params = {str(n.target).rpartition(".")[2]: stage.get_parameter(str(n.target)) for n in region if n.op == "get_attr"}
        stage.set_submodule(path, ExpertParallel(module, params, ep_mesh, count, divide))
        with stage.graph.inserting_before(outputs[0]):
            call = stage.graph.call_module(path, (hidden, index, weights))
        outputs[0].replace_all_uses_with(call)
        for n in reversed(region):
            stage.graph.erase_node(n)
        done.append(path)
    stage.graph.lint()
    stage.recompile()
    return done


def _within(path: str, module: str) -> bool:
    return path == module or path.startswith(f"{module}.")


def _roles(inputs: list[fx.Node], path: str) -> tuple[fx.Node, fx.Node, fx.Node]:
    """(hidden states, top-k indices, top-k weights) among the values the experts read, by dtype and shape."""
    vals: list[Any] = [n.meta.get("val") for n in inputs]
    if len(inputs) != 3 or not all(isinstance(v, torch.Tensor) for v in vals):
        raise CodegenError(advice(
            f"the experts at {path!r} read {len(inputs)} values from the rest of the stage",
            "expert parallelism runs the experts module's forward(hidden_states, top_k_index, top_k_weights)",
            "plan with expert_parallel=1",
        ))
    index = next((n for n, v in zip(inputs, vals) if not v.is_floating_point()), None)
    floats = [(n, v) for n, v in zip(inputs, vals) if v.is_floating_point()]
    if index is None or len(floats) != 2:
        raise CodegenError(advice(f"the experts at {path!r} read no integer index beside two floating tensors",
                                  "the router hands the experts its top-k indices and weights", "plan with expert_parallel=1"))
    k = index.meta["val"].shape[-1]
    weights = next((n for n, v in floats if v.shape[-1] == k and v.dim() == 2), None)
    hidden = next((n for n, _ in floats if n is not weights), None)
    if weights is None or hidden is None:
        raise CodegenError(advice(f"the experts at {path!r}: no (tokens, {k}) weights among their inputs",
                                  "the router hands the experts one weight per choice", "plan with expert_parallel=1"))
    return hidden, index, weights

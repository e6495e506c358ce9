"""What the annotate pass writes on every node: a :class:`NodeInfo` in ``node.meta["autosplit"]``.

The record every later pass reads (the cost table, the makespan runtime, calibration): shapes,
bytes, FLOPs, parameters and saved activations of one node for one example batch, as
:func:`autosplit.passes.annotate.annotate` measured them on fake tensors.

Usage::

    info = node_info(node)
    info.fwd_flops, info.saved_bytes
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autosplit.errors import CostModelError, advice

__all__ = ["NodeInfo", "node_info"]


@dataclass(frozen=True)
class NodeInfo:
    """What one node computes and keeps, for one example batch."""

    module_path: str
    output_shapes: tuple[tuple[int, ...], ...]
    output_bytes: int
    """Bytes of every tensor the node outputs (what a transfer moves forward)."""
    input_bytes: int
    fwd_flops: int
    bwd_flops: int
    saved_bytes: int
    """Bytes of tensors the node makes that autograd keeps until backward (its output when
    saved, internal buffers); parameters and the node's inputs are not counted here."""
    saved_inputs: tuple[str, ...]
    """Nodes whose output this node saves for backward (each storage is counted once, at
    its producer, by the cost table)."""
    saves_output: bool
    """The node's own output is among what it saves (already in ``saved_bytes``)."""
    params: tuple[str, ...]
    """Qualified names of the parameters this node owns (first use only; each counted once)."""
    param_bytes: int
    param_count: int
    largest_param_bytes: int
    """Bytes of the largest parameter tensor it owns (the optimizer's temporaries scale with it)."""
    buffer_bytes: int
    half: bool
    """Computes in fp16/bf16 (tensor-core peak applies)."""
    mutates: tuple[str, ...] = ()
    """Input nodes whose value this node writes in place (``relu_``, ``x += y``, a leaf module
    writing its argument), seen from the tensors' version counters when it ran."""
    wgrad_share: float = 0.0
    """The share of the backward that is the gradient to parameters (the weight-gradient pass W of
    a split backward; the rest is the input-gradient pass I): by flops, or 1 when parameters are
    all that needs a gradient (an embedding)."""
    weight_copy_bytes: int = 0
    """Of :attr:`saved_bytes`, the low-precision copies of parameters autocast makes for this node and
    it saves — under ``"bf16-fsdp"``, the bf16 copy FSDP2 gathers of the parameters it owns: one copy,
    which the runtime makes once per step and every micro-batch shares (the cost table holds it with
    the model state)."""
    row_grad_bytes: int = 0
    """For the node that owns an embedding table read only by lookups (``nn.Embedding``,
    ``F.embedding``, ``aten.embedding``; not a table tied to an output layer): bytes of the rows the
    batch looks up, with a 64-bit index each, at most the whole table — the non-zero part of its
    gradient, which a sparse all-gather moves instead of the dense table (:func:`~autosplit.passes.sparse_tables.row_sparse`)."""
    sparse_table_bytes: int = 0
    """Of those tables, the bytes of the ones every lookup reads with ``sparse=True``: torch makes
    their gradient a sparse tensor and never the dense one."""
    moves_nothing: bool = False
    """It reads and writes no bytes: every tensor it returns is a view of an input's storage (a view, a reshape that
    needs no copy, a cast to the dtype a tensor has) and it writes none in place, or it returns none (an assertion).
    A GPU runs no kernel for it; the time model costs it nothing."""
    sparse_grad_bytes: int = 0
    """Bytes of that sparse gradient for the whole batch: a row and a 64-bit index per lookup,
    repeats included (torch's sparse embedding backward keeps each lookup's row, and accumulating
    micro-batches concatenates them), not capped at the table."""



def node_info(node: fx.Node) -> NodeInfo:
    try:
        return node.meta["autosplit"]
    except KeyError:
        raise CostModelError(advice(
            f"node {node.format_node()} has no annotation", "the cost model ran before the annotate pass",
            "run passes.annotate on the captured graph first",
        )) from None

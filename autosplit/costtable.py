"""The cost table: per-node costs on every device, and the graph facts the solver needs.

Plain data, written by the *estimate* pass (:mod:`autosplit.passes.costs`) or loaded from a file
(``costs=path``), read by the compiler to build the solver's problem. No torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from autosplit.devices import DeviceSpec
from autosplit.errors import CostModelError, advice

__all__ = [
    "OPTIMIZER_SPARSE_STEP", "OPTIMIZER_STATE_BYTES", "OPTIMIZER_STEP_TRAFFIC", "OPTIMIZER_TEMP_FACTOR",
    "OVERRIDE_KEYS", "SPARSE_REFUSED", "CostTable",
]

# Optimizer state bytes per fp32 parameter; torch.optim keeps the moments in the parameter's dtype
# (``zeros_like(param)``), so a bf16 parameter's state is half this.
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "adagrad": 4, "sgd_momentum": 4, "sgd": 0, "none": 0}


# Temporaries of one optimizer step, in units of the parameter tensor being updated:
# torch's single-tensor Adam computes (exp_avg_sq.sqrt() / c).add_(eps), two new tensors; Adagrad
# state_sum.sqrt().add_(eps), one.
OPTIMIZER_TEMP_FACTOR = {"adam": 2, "adamw": 2, "adagrad": 1, "sgd_momentum": 0, "sgd": 0, "none": 0}


# Bytes one optimizer step reads and writes per byte of parameter, and the ops it launches per
# parameter tensor, counted from torch's single-tensor implementations (the CPU default):
# Adam: exp_avg.lerp_(g) 3, exp_avg_sq.mul_().addcmul_() 2 + 4, denom = (sqrt / c).add_(eps)
# 2 + 2 + 2, param.addcdiv_(exp_avg, denom) 4 → 19 tensor passes; AdamW adds param.mul_() 2.
# Adagrad: state_sum.addcmul_(g, g) 3, std = sqrt().add_(eps) 2 + 2, param.addcdiv_(g, std) 4 → 11.
# SGD: param.add_(g) 3; with momentum buf.mul_().add_(g) 2 + 3 first.
OPTIMIZER_STEP_TRAFFIC = {
    "adam": (19, 7), "adamw": (21, 8), "adagrad": (11, 4), "sgd_momentum": (8, 3), "sgd": (3, 1), "none": (0, 0),
}


# The optimizers whose step over a sparse gradient (an ``nn.Embedding(sparse=True)`` table's)
# touches only its rows: the step's passes over the gradient's bytes (values with their indices),
# its ops, and its temporaries in units of the gradient, counted from torch's sparse branches.
# Adagrad coalesces the gradient 2, squares it 2, adds it into state_sum's rows 3, reads those rows
# back (sparse_mask) 2, sqrt_ 2, add_(eps) 2, divides the gradient by them 3 and adds the result
# into the parameter's rows 3 → 19, holding the coalesced gradient, its squares, the rows read back
# and the quotient; SGD adds the gradient into the parameter's rows, 3. Adam and AdamW refuse
# sparse gradients; SGD with momentum takes them, but its buffer gathers every row ever touched
# and is costed dense.
OPTIMIZER_SPARSE_STEP = {"adagrad": (19, 8, 4), "sgd": (3, 1, 0), "none": (0, 0, 0)}
SPARSE_REFUSED = ("adam", "adamw")
"""Optimizers torch refuses sparse gradients to (``RuntimeError`` in their step)."""


OVERRIDE_KEYS = ("fwd", "bwd", "saved_bytes")


@dataclass(frozen=True)
class CostTable:
    """Per-node costs on every device, plus the graph facts the solver needs. Plain data."""

    devices: tuple[DeviceSpec, ...]
    nodes: tuple[str, ...]
    """Placeable nodes in graph (topological) order: everything but placeholders and output."""
    module_paths: tuple[str, ...]
    fwd_time: tuple[tuple[float, ...], ...]
    """[node][device] forward seconds for the example batch."""
    bwd_time: tuple[tuple[float, ...], ...]
    state_bytes: tuple[int, ...]
    """What each node holds for the whole step, whatever the micro-batches: its parameters,
    gradients, optimizer state and buffers, and the compute copy of its weights a mixed precision
    makes once per step (:attr:`weight_copy_bytes`) — per device, as the data-parallel layout holds
    them (:func:`autosplit.passes.sharding.laid_out`)."""
    saved_bytes: tuple[int, ...]
    output_bytes: tuple[int, ...]
    edges: tuple[tuple[int, int], ...]
    """Data edges (producer index, consumer index) between placeable nodes."""
    order_edges: tuple[tuple[int, int], ...]
    """Precedence without data (around in-place writes)."""
    colocate: tuple[tuple[int, ...], ...]
    """Groups of node indices that must share a device."""
    param_counts: tuple[int, ...]
    sent_bytes: tuple[int, ...] = ()
    """[node] bytes its stage holds when the output goes to another stage (0 when the
    output is already counted as saved)."""
    transient_bytes: tuple[int, ...] = ()
    """[node] peak bytes above what is live while the node runs on one micro-batch; empty: output bytes /
    micro-batches (:attr:`peaks` adds the optimizer step's)."""
    step_bytes: tuple[int, ...] = ()
    """[node] bytes the optimizer step allocates while it updates the node's parameters as this device holds them (its
    shard, its experts: the temporaries of its largest local parameter); empty: none counted apart."""
    optimizer_time: tuple[tuple[float, ...], ...] = ()
    """[node][device] seconds of the optimizer step over the parameters the node owns (once per step)."""
    param_bytes: tuple[int, ...] = ()
    """[node] bytes of the parameters it owns (what its gradient all-reduce and optimizer step touch)."""
    weight_copy_bytes: tuple[int, ...] = ()
    """[node] of :attr:`state_bytes`, the low-precision copy of its weights autocast makes, once per step
    (empty: none)."""
    buffer_bytes: tuple[int, ...] = ()
    """[node] of :attr:`state_bytes`, its buffers (never sharded; empty: none)."""
    unit_params: tuple[bool, ...] = ()
    """[node] its parameters are in an FSDP unit of their own when FSDP runs alone, gathered only while
    the unit runs: a node of a block the runtime outlines (:func:`autosplit.passes.outline.outlinable_blocks`),
    or one calling a module that is a unit (:func:`autosplit.passes.outline.unit_targets`); empty: none."""
    row_grad_bytes: tuple[int, ...] = ()
    """[node] for an embedding table it owns, bytes of the rows the batch looks up (with their
    indices): its gradient's non-zero part (:attr:`~autosplit.passes.annotations.NodeInfo.row_grad_bytes`); else 0. Empty: none."""
    param_reads: tuple[str, ...] = ()
    """[node] the qualified name of the parameter the node reads by name (``get_attr``), else ``""``:
    such an output is the same for every
    micro-batch, so a later stage that reads it gets it once per micro-batch or keeps a replica
    whose gradient is summed once per step (a tied weight)."""
    wgrad_share: tuple[float, ...] = ()
    """[node] the share of its backward that is the gradient to its own parameters — the weight
    pass (W) a zero-bubble schedule runs apart from the input pass (I = the rest) — timed in a
    split-backward profile, else from the two passes' flops; empty: none (``B = I``)."""
    split_cost: tuple[tuple[float, ...], ...] = ()
    """[node][device] seconds (whole batch) of :attr:`bwd_time` that splitting the backward into
    I and W costs (measured: torch's two passes against one whole backward); torch's first stage
    of a split backward runs its backward whole and does not pay it. Empty: none."""
    wgrad_bytes: tuple[int, ...] = ()
    """[node] bytes (whole batch) of the gradient a split backward keeps from I until W (at the
    node's output, where the weight gradient starts); what the node saves is kept too."""
    output_tensors: tuple[int, ...] = ()
    """[node] tensors in its output: each crossing pays the link latency once per micro-batch; a
    Python value (a shape int) crosses as a constant and pays nothing. Empty: one each."""
    input_free: tuple[bool, ...] = ()
    """[node] its value depends on no input, parameter or buffer (:mod:`autosplit.passes.input_free`):
    each stage that reads it makes it, so it never crosses a boundary — the reading stage pays its
    computing and holds its copy instead of the transfer and the pipeline buffers. Empty: none."""

    blocks: tuple[str, ...] = ()
    """Labels (module paths) of the blocks a plan may recompute in the backward (activation checkpointing)."""
    block_members: tuple[tuple[int, ...], ...] = ()
    """[block] its node indices."""
    block_saves: tuple[int, ...] = ()
    """[block] bytes (whole batch) its stage no longer holds when it recomputes: its members'
    activations, less the inputs the checkpoint keeps — an input that k blocks read (a mask, the
    rotary tables), kept once for all of those that recompute, charged 1/k to each, so that the
    blocks' savings add up to what recomputing them all saves."""
    block_shared: tuple[int, ...] = ()
    """[block] bytes (whole batch) of such shared inputs beyond its 1/k shares: what it holds more when
    it recomputes and the other readers do not (the solver keeps it as room). Empty: none."""
    block_transient: int = 0
    """The largest transient (one micro-batch) of a block's node as the node itself peaks, before the
    FSDP layout's unit gathers: what a recomputing block's backward adds its activations to."""
    block_activations: tuple[int, ...] = ()
    """[block] bytes (whole batch) of its activations, held again (one micro-batch's share) while its
    backward recomputes it."""
    block_refusal: tuple[str, ...] = ()
    """[block] why recomputing it would train differently, or ``""``."""
    recomputed: tuple[str, ...] = ()
    """The blocks whose costs here are the recomputing ones (backward includes the forward again,
    activations are the checkpoint's inputs)."""
    recompute_kept: tuple[tuple[int, int], ...] = ()
    """[recomputed block] (micro-batches it keeps, of every so many its stage holds at once):
    :class:`~autosplit.plans.PartialRecompute`; (0, 1) for one that recomputes every micro-batch."""
    recompute_keeps: tuple[int, ...] = ()
    """Nodes whose output a recomputed block keeps (its matmuls and attention, when blocks recompute
    selectively: :mod:`autosplit.passes.selective`): their forward does not run again. Empty: none."""
    rerun_time: tuple[tuple[float, ...], ...] = ()
    """[node][device] seconds the node runs again in the backward when its block recomputes, where tensor
    parallelism's collectives make that differ from its forward (:mod:`autosplit.passes.tp_costs`).
    Empty: its forward, none for a node in ``recompute_keeps``."""
    float8_recipe: str | None = None
    """The FP8 recipe the linears in :attr:`float8_linears` are costed in (:mod:`autosplit.passes.float8`); None: none."""
    float8_linears: tuple[str, ...] = ()
    """Module paths of the linears costed in FP8."""
    float8_kept: tuple[tuple[str, str], ...] = ()
    """(module path, why) of the linears kept in bf16 under a float8 option."""
    expert_gemms: tuple[tuple[int, float, tuple[tuple[float, ...], ...]], ...] = ()
    """(node, the share of micro-batches its backward runs its forward again, [device] its
    :func:`~autosplit.passes.ep_costs.gemm_terms`) of each grouped matmul of a mixture of experts' rows costed by
    the roofline (none measured): what expert parallelism costs anew, each rank reading its own experts' weights."""

    @functools.cached_property
    def peaks(self) -> tuple[int, ...]:
        """[node] the transient peak above what is live: while the node runs, or while the optimizer steps its parameters."""
        if not self.step_bytes:
            return self.transient_bytes
        return tuple(max(t, s) for t, s in zip(self.transient_bytes or (0,) * len(self.step_bytes), self.step_bytes))

    def row_sparse(self, members: Iterable[int]) -> tuple[int, int]:
        """(``sparse_param_bytes``, ``row_grad_bytes``) of :class:`~autosplit.plans.StageReport` for the nodes ``members``."""
        rows = [n for n in members if self.row_grad_bytes and self.row_grad_bytes[n]]
        return sum(self.param_bytes[n] for n in rows), sum(self.row_grad_bytes[n] for n in rows)

    def save(self, path: str | Path) -> None:
        """Write the table as JSON, to edit or to plan with again (``costs=path``)."""
        data = dataclasses.asdict(self)
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        try:
            data = json.loads(Path(path).read_text())
            data["devices"] = tuple(DeviceSpec.from_dict(d) for d in data["devices"])
            return cls(**{k: _frozen(v) if k != "devices" else v for k, v in data.items()})
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise CostModelError(advice(
                f"cannot read a cost table from {path}: {type(e).__name__}: {e}",
                "the file is missing, damaged, or was written by another version", "save the table again (CostTable.save)",
            )) from e


def _frozen(value):
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value

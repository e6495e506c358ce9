"""Engine profiles: what a training stack's kernels reach of a GPU's peaks, fitted once to the published record.

A preset (:mod:`autosplit.gpu_presets`) holds a GPU's spec-sheet peaks. What a step reaches of them depends on
the stack that runs it: Megatron-Core with Transformer Engine fuses its norms, activations and attention into
few kernels and tunes its GEMMs; torchtitan in eager mode launches torch's kernels one by one; with
``torch.compile`` Inductor fuses the memory-bound ops between the matmuls. An :class:`EngineProfile` says what
each reaches — ``gemm``: the fraction of the tensor-core peak its GEMMs and attention run at, in any precision;
``memory``: the fraction of the HBM bandwidth its memory-bound ops run at (fusion shows here: fewer bytes
moved reads as more bandwidth); ``attention``: the share of ``gemm`` its attention kernels reach (torch's
scaled-dot-product attention runs FlashAttention-2, Transformer Engine cuDNN's fused attention); ``tp_overlap``: the
share of a tensor-parallel collective it hides behind the GEMM beside it when a plan runs ``async_tp`` — and
:func:`profiled` puts it on a device.

Every fitted parameter of the cost model is in :data:`FITTED`, with what it fits and over which rows; nothing
else in autosplit is fitted to the record. ``benchmarks/published_fit.py`` fits them from a ``benchmarks/published.py
--grid`` run (the commands and the figures: ``docs/published.md``).

Usage::

    device = profiled(GPU_PRESETS["H100-80GB"], "megatron-te")
    cluster = Cluster.of("GB200", 256, engine="megatron-te")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from autosplit.device_spec import DeviceSpec
from autosplit.errors import ConstraintError, advice
from autosplit.gpu_presets import GPU_PRESETS, SYSTEMS

__all__ = ["ENGINES", "EngineProfile", "FITTED", "Fitted", "RECORD", "engine_of", "profiled", "trust"]


@dataclass(frozen=True)
class Fitted:
    """One fitted parameter: its value, what it fits, and the rows it was fitted over."""

    value: float
    fits: str
    over: str


FITTED: dict[str, Fitted] = {
    "megatron-te.gemm": Fitted(0.60, "fraction of the tensor-core peak Megatron-Core + Transformer Engine GEMMs reach, bf16 and FP8",
                               "35 Megatron-Bridge, Megatron-LM and NeMo rows (H100, B200, GB200, GB300)"),
    "megatron-te.attention": Fitted(0.65, "the share of that its attention kernels (cuDNN's fused attention) reach",
                                    "the same 35 rows"),
    "torch-eager.gemm": Fitted(0.44, "the same, torchtitan without torch.compile", "1 torchtitan row (row 294, 500 W H100)"),
    "torch-compile.gemm": Fitted(0.54, "the same, torchtitan with torch.compile", "7 torchtitan rows (500 W H100, H200)"),
    "torch-compile.attention": Fitted(0.45, "the share of that torch's scaled-dot-product attention (FlashAttention-2) reaches, "
                                      "compiled or eager (Inductor leaves it alone)", "the same 7 rows"),
    "megatron-te.tp_overlap": Fitted(1.0, "share of a tensor-parallel collective Megatron's --tp-comm-overlap hides behind "
                                     "the GEMM beside it (at most that GEMM's time; the grid's highest point)",
                                     "the 20 of those 35 rows with TP > 1"),
    "torch-compile.tp_overlap": Fitted(1.0, "the same, torchtitan's async TP (compiled only; the grid's highest point)",
                                       "row 305 (async TP) beside row 304 (vanilla)"),
    "megatron-te.ep_overlap": Fitted(0.6, "share of a layer's expert all-to-alls Megatron's batch-level overlap "
                                     "(--overlap-moe-expert-parallel-comm) hides behind another micro-batch's compute of the "
                                     "layer (at most that compute)",
                                     "the 11 Megatron-Bridge MoE rows that ran it and are costed (rows 2, 8, 22, 24, 29, 30, 31, 33, "
                                     "133, 177, 215; not 210 and 213, bound elsewhere), at the figures above"),
    "float8.rowwise": Fitted(0.53, "the share of a tensorwise FP8 GEMM's speed a rowwise-scaled one reaches (torchao)",
                             "row 316 (torchtitan 70B FSDP 32 × TP 8, rowwise), at the figures above, each tp rank casting "
                             "the whole operands it gathers"),
    "memory": Fitted(0.9, "fraction of the HBM bandwidth memory-bound ops reach, every engine alike (the fewer bytes a fused "
                     "kernel moves read as bandwidth here; the grid's highest point)", "the 47 rows above together (first fit)"),
}
"""Every parameter fitted to the published record, by name: the one place they live."""


RECORD: dict[tuple[str, str], tuple[float, float, int]] = {
    ("B200", "megatron-te"): (0.130, 0.152, 10),
    ("GB200", "megatron-te"): (0.034, 0.158, 22),
    ("GB300", "megatron-te"): (0.086, 0.134, 13),
    ("H100", "megatron-fsdp"): (0.065, 0.065, 1),
    ("H100", "megatron-te"): (0.060, 0.121, 19),
    ("H100-500W", "torch-compile"): (0.025, 0.268, 11),
    ("H100-500W", "torch-eager"): (0.001, 0.001, 1),
    ("H200", "torch-compile"): (0.025, 0.025, 1),
}
"""(GPU kind, engine) → (median, 90th percentile of |predicted / published − 1|, runs) over the published rows
of that kind and engine, with :data:`FITTED` as it stands: ``benchmarks/published.py`` writes them
(``benchmarks/results/published.json``); a plan's report quotes them (:func:`trust`)."""


@dataclass(frozen=True)
class EngineProfile:
    """A training stack's kernels: the fractions of a GPU's peaks they reach (:data:`FITTED`)."""

    name: str
    description: str
    fuses: tuple[str, ...] = ()
    """The fused kernels whose savings the memory model counts (:data:`autosplit.passes.fusion.FUSIONS`)."""
    distributed_optimizer: bool = False
    """Its data-parallel sharding is Megatron's distributed optimizer: the gradients reduced into one whole buffer,
    the fp32 master weights and the optimizer's moments sharded; ``False``: FSDP2's (a gradient shard kept apart)."""
    buffers_in_flight: bool = False
    """Its pipeline holds a receive buffer per micro-batch in flight (Megatron's p2p communication allocates one per
    send); ``False``: one per micro-batch of the step, as torch's ``PipelineStage`` makes them (torchtitan)."""
    frees_sent_outputs: bool = False
    """A stage frees each output it has sent on (Megatron's ``deallocate_pipeline_outputs``): a tensor a later stage
    saves is held once, where the memory model charges it; ``False``: the sender keeps it until its backward and
    the receiver its own copy, as torch's ``PipelineStage`` does."""
    bf16_gradients: bool = False
    """Its gradients are accumulated and reduced in bf16 (Megatron-Bridge's and NeMo's performance recipes set
    ``grad_reduce_in_fp32=False``): half the bytes held and reduced; ``False``: fp32 (FSDP2's ``reduce_dtype``)."""
    units_per_micro_batch: bool = False
    """Its FSDP gathers each layer for every micro-batch and reshards it after, whatever the micro-batches
    (Megatron-FSDP, ``optim_grads_params``); ``False``: FSDP2 as autosplit runs it, a stage of several
    micro-batches gathered once for the step (:func:`~autosplit.passes.sharding.sharded_alone`)."""
    kernels: str = ""
    """The profile whose fitted kernels it runs (its own name when empty)."""
    attention_kernel: str = ""
    """The profile whose fitted attention share its flash kernels take (:attr:`kernels` when empty): torchtitan's
    eager and compiled runs call the same scaled-dot-product attention, FlashAttention-2, which Inductor leaves alone."""

    @property
    def gemm(self) -> float:
        return FITTED[f"{self.kernels or self.name}.gemm"].value

    @property
    def memory(self) -> float:
        return FITTED["memory"].value

    @property
    def attention(self) -> float:
        """The share of :attr:`gemm` its attention kernels reach (1 where none is fitted)."""
        fitted = FITTED.get(f"{self.attention_kernel or self.kernels or self.name}.attention")
        return 1.0 if fitted is None else fitted.value

    @property
    def ep_overlap(self) -> float:
        """0 where the engine overlaps no expert all-to-all with another micro-batch (torchtitan)."""
        fitted = FITTED.get(f"{self.kernels or self.name}.ep_overlap")
        return 0.0 if fitted is None else fitted.value

    @property
    def tp_overlap(self) -> float:
        """0 where the engine overlaps no tensor-parallel collective (torchtitan eager: async TP needs compile)."""
        fitted = FITTED.get(f"{self.kernels or self.name}.tp_overlap")
        return 0.0 if fitted is None else fitted.value


_TRANSFORMER_ENGINE = ("norm", "gated", "fp8-inputs", "fp8-weights", "fp8-experts")

ENGINES: dict[str, EngineProfile] = {
    e.name: e for e in (
        EngineProfile("megatron-te", "Megatron-Core with Transformer Engine (Megatron-LM, Megatron-Bridge, NeMo), sharded by "
                      "its distributed optimizer", _TRANSFORMER_ENGINE, distributed_optimizer=True, buffers_in_flight=True,
                      frees_sent_outputs=True, bf16_gradients=True),
        EngineProfile("megatron-fsdp", "Megatron-Core with Transformer Engine sharded by Megatron-FSDP (use_megatron_fsdp: "
                      "weights, gradients and optimizer state)", _TRANSFORMER_ENGINE, buffers_in_flight=True,
                      frees_sent_outputs=True, bf16_gradients=True, units_per_micro_batch=True, kernels="megatron-te"),
        EngineProfile("torch-eager", "torchtitan, PyTorch eager: torch's kernels, one launch per op", attention_kernel="torch-compile"),
        EngineProfile("torch-compile", "torchtitan under torch.compile: Inductor fuses the ops between matmuls", ("norm", "gated")),
    )
}


def profiled(device: DeviceSpec, engine: str) -> DeviceSpec:
    """``device`` as ``engine`` runs it: its efficiencies the engine's (:data:`FITTED`), its name saying which."""
    profile = ENGINES.get(engine)
    if profile is None:
        raise ConstraintError(advice(
            f"engine profile {engine!r} is not known", "a profile is a training stack the record was fitted for",
            f"pass one of {', '.join(ENGINES)}",
        ))
    return dataclasses.replace(device, name=f"{device.name} ({engine})", efficiency=profile.gemm, memory_efficiency=profile.memory,
                               tp_overlap=profile.tp_overlap, ep_overlap=profile.ep_overlap, attention_share=profile.attention,
                               engine=engine)


def engine_of(devices: Sequence[DeviceSpec]) -> EngineProfile | None:
    """The engine profile the first of ``devices`` was costed with (:func:`profiled`), or ``None``."""
    return ENGINES.get(devices[0].engine or "") if devices else None


def trust(devices: tuple[DeviceSpec, ...]) -> str | None:
    """How far the published record says to trust a plan's times on ``devices``: the device preset and engine
    profile they were costed with and the record's error there; ``None`` for devices of neither (a CPU, a spec
    of your own)."""
    preset = devices[0].name.partition(" (")[0]  # profiled() appends the engine to the preset's name
    profile = engine_of(devices)
    if preset not in GPU_PRESETS:
        return None
    if profile is None:
        return (f"costed on {preset}'s spec-sheet peaks at an efficiency nobody fitted to a measured run; "
                f"plan on Cluster.of(gpu, count, engine=...) with one of {', '.join(ENGINES)} for a profile fitted to the published record")
    kind = next(k for k, system in SYSTEMS.items() if system.preset == preset)
    engine = profile.name
    figures = RECORD.get((kind, engine))
    record = (f"against the published record on {kind} with {engine}: median {figures[0]:.0%}, 90th percentile {figures[1]:.0%} "
              f"over {figures[2]} runs" if figures else f"the published record has no run on {kind} with {engine} to check it against")
    return f"costed with device preset {preset} (spec sheet) and engine profile {engine} (fitted, autosplit.engine_profiles); {record}"

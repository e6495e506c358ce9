"""Runtimes: what runs a plan. They read plans and generated stages; they never plan.

- :mod:`.local` — :class:`~.local.SplitModule`, every stage in this process, one after another;
- :mod:`.distributed` — :class:`~.distributed.DistributedModel`, a ``torch.distributed.pipelining``
  stage per process on a ``("pp", "dp_replicate", "dp_shard", "tp")`` device mesh (built by
  :func:`autosplit.distribute`; :mod:`.placement`), its copies kept in step by FSDP2; its flushed
  step in :mod:`.flushed`, its schedule per batch size in :mod:`.runs`;
- :mod:`.batches` — batches of other sizes than the example's, checked on every rank;
- :mod:`.loop` — the training loop's verbs on a pipeline: ``train()``/``eval()``, forward-only
  ``pipe(...)`` and ``eval_step``, ``clip_grad_norm_``; :mod:`.gradients` the norm over every rank;
- :mod:`.compiled` — ``compile=True``: each stage compiled with ``torch.compile``, or told why not;
- :mod:`.stage` — the pipelining stage that posts a step's receives early;
- :mod:`.asynchronous` — XPipe / PipeDream's asynchronous loop; :mod:`.prediction` its weight prediction;
- :mod:`.makespan` — :class:`~.makespan.MakespanRunner`, a makespan plan's tasks in one process.
"""

from autosplit.runtime.local import SplitModule

__all__ = ["SplitModule"]

"""Runtimes: what runs a plan.

- :mod:`.local` — :class:`SplitModule`, every stage in this process, one after another
  (model parallelism for memory; wrap it in DDP for data parallelism);
- :mod:`.microbatch` — how a batch is cut into micro-batches, for every runtime;
- :mod:`.distributed` — pipeline stages on ``torch.distributed.pipelining``, one per
  process, replicated over a ``("pp", "dp")`` device mesh (imported by ``autosplit`` itself:
  it builds on the planner, which builds on the local runtime).
"""

from autosplit.runtime.local import SplitModule
from autosplit.runtime.microbatch import split_batch

__all__ = ["SplitModule", "split_batch"]

"""The verbs: each plans, then builds or measures. The only room that imports the compiler and
the runtimes together.

- :mod:`.planner` — :class:`Planner` (capture once, plan, build, "what if") and the one-liners
  :func:`plan` and :func:`autosplit`;
- :mod:`.distributed` — :func:`distribute`: rank 0 plans, every rank builds its stage;
- :mod:`.comparison` — :func:`compare`: autosplit's plan beside manual splits, predicted and measured;
- :mod:`.hybrid` — :func:`plan_hybrid`: how many devices form each data-parallel worker.
"""

from typing import TYPE_CHECKING, Any

from autosplit.api.comparison import compare
from autosplit.api.hybrid import measure_noise_scale, plan_hybrid
from autosplit.api.planner import Planner, autosplit, plan
from autosplit.errors import unknown_name

if TYPE_CHECKING:
    from autosplit.api.distributed import distribute

__all__ = ["Planner", "autosplit", "compare", "distribute", "measure_noise_scale", "plan", "plan_hybrid"]


def __getattr__(name: str) -> Any:
    """:func:`distribute` on first use: its runtime imports ``torch.distributed.pipelining`` (and with it
    ``torch._dynamo`` and FSDP), which planning never needs."""
    if name == "distribute":
        from autosplit.api.distributed import distribute

        return distribute
    raise unknown_name(__name__, name)

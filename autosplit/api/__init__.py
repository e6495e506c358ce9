"""The verbs: each plans, then builds or measures. The only room that imports the compiler and
the runtimes together.

- :mod:`.planner` — :class:`Planner` (capture once, plan, build, "what if") and the one-liners
  :func:`plan` and :func:`autosplit`;
- :mod:`.distributed` — :func:`distribute`: rank 0 plans, every rank builds its stage;
- :mod:`.comparison` — :func:`compare`: autosplit's plan beside manual splits, predicted and measured;
- :mod:`.hybrid` — :func:`plan_hybrid`: how many devices form each data-parallel worker.
"""

import importlib
from typing import TYPE_CHECKING, Any

from autosplit.errors import unknown_name

if TYPE_CHECKING:
    from autosplit.api.comparison import compare
    from autosplit.api.distributed import distribute
    from autosplit.api.hybrid import measure_noise_scale, plan_hybrid
    from autosplit.api.planner import Planner, autosplit, plan

__all__ = ["Planner", "autosplit", "compare", "distribute", "measure_noise_scale", "plan", "plan_hybrid"]

_ROOMS = {"Planner": "planner", "autosplit": "planner", "plan": "planner", "compare": "comparison",
          "distribute": "distributed", "measure_noise_scale": "hybrid", "plan_hybrid": "hybrid"}
"""Each verb's module, imported on first use: planning needs neither the comparison's reports nor the
distributed runtime (``torch.distributed.pipelining``, and with it ``torch._dynamo`` and FSDP)."""


def __getattr__(name: str) -> Any:
    if name in _ROOMS:
        return getattr(importlib.import_module(f"{__name__}.{_ROOMS[name]}"), name)
    raise unknown_name(__name__, name)

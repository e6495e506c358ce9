"""Calibration: measure this machine, and fit the cost model's device figures to it.

- :mod:`.efficiency` — :func:`calibrate`: compute efficiency and per-op overhead from a profile;
- :mod:`.link` — :func:`measure_link`: point-to-point latency and bandwidth;
- :mod:`.overhead` — :func:`measure_runtime`: the pipeline runtime's cost per micro-batch;
- :mod:`.stages` — :func:`measure_stages`: a split's stages timed one by one;
- :mod:`.pair` — the two fresh processes the link and runtime measurements run in.
"""

from autosplit.calibration.efficiency import Calibration, calibrate
from autosplit.calibration.link import LinkMeasurement, measure_link
from autosplit.calibration.overhead import RuntimeMeasurement, measure_runtime
from autosplit.calibration.stages import StageMeasurement, measure_stages

__all__ = ["Calibration", "LinkMeasurement", "RuntimeMeasurement", "StageMeasurement", "calibrate", "measure_link",
           "measure_runtime", "measure_stages"]

"""``flexsearch calibrate``: fit the simulator's calibration to this machine's real runs.

- :mod:`.probes`: the probe models and the measurements taken on them;
- :mod:`.fit`: pure fits from measured numbers to terms;
- :mod:`.run`: the command: stages, resuming, the residual fits in order, the
  atomic write of the calibration file (format: :mod:`flexsearch.cost.calibration`).

The calibration command runs emitted plans (:mod:`flexsearch.measure`) and the
simulator, so it sits downstream of both, next to the other commands' modules
(``bench``, ``report``), not in :mod:`flexsearch.cost`, whose modules only describe
hardware and costs.
"""

from flexsearch.calibrate.run import CalibrationResult, Settings, calibrate

__all__ = ["CalibrationResult", "Settings", "calibrate"]

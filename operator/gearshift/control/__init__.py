"""The operator's decisions, pure (no I/O, no clock: times are passed in), one subpackage per loop; the
handlers (:mod:`gearshift.handlers`) read the API and Prometheus, call these, write and record.

- :mod:`.reconcile`: a PDService and its GearSets → the objects that serve it, and their conditions;
- :mod:`.shifting`: the gear controller: signals → decision (``decide``, ``triggers``, ``capacity``,
  ``cost``) → the shift executor's next step (``executor``), and what its tick writes to status;
- :mod:`.autoscale`: pipeline replicas per role (``scaling``, HPA-style) mapped onto GearSets (``tick``);
- :mod:`.adaptive_batch`: the decode gear's batch size from the router's rule (``pd_balance``).

Shared by the loops: :mod:`.signals` (PromQL texts and parsing), :mod:`.smoothing` (one sample and its
moving average) and :mod:`.windows` (time-limited nodes).
"""

"""The PDService reconciler's decisions, without I/O: :mod:`gearshift.handlers.reconcile` reads and writes.

The handler reads the PDService, its two GearSets, the fleet and the owned objects, and hands them to
these modules' functions in this order; ``gearshift render`` (:mod:`gearshift.commands.rendering`) calls
the same functions on files, so what it prints is what a first reconcile applies:

- :mod:`.spec`: ``role_state``, ``explicit_layer_problems``, ``explicit_engine_problems`` check each
  GearSet against its role, the model's layers and the engine (raise ``SpecInvalid``);
- :mod:`.desired`: ``desired_state`` plans the ``auto`` roles on their share of the fleet (:mod:`.planning`),
  picks each role's active gear and checks the running gears' placement (:mod:`.placement`);
  ``gearset_status_patch`` is the GearSet status (plan, active gear, phase, Planned condition);
  ``stale_statefulsets``, ``stale_gear_services`` the owned objects no wanted gear has any more;
- :mod:`.rollout`: the conditions written before applying objects that start a rollout;
- :mod:`.readiness`: ``role_readiness``, ``readiness_patch``: each role's Ready pods and pipelines;
- :mod:`.verdict`: ``service_verdict``: the PDService's conditions (Placed, Degraded, Progressing, Ready),
  its phase and status; ``refusal`` and ``gearsets_missing`` when it cannot be served.

:mod:`.state` holds what they share (``RoleState``, ``DesiredState``, the errors, the condition reasons).
Pure: time (``now``) is passed in, nothing reads the clock or the API. Planning may be memoised by the
caller (``memo`` of ``desired_state``, the handler's plan cache); without one it plans every time.
"""

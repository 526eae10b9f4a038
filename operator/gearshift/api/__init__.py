"""The three custom resources of gearshift as pydantic models, and the CRDs generated from them.

Modules: ``common`` (base configs, conditions and their setter, condition types, event reasons, name
limits), ``gpuprofile``, ``gearset``, ``pdservice`` (one kind each; the GearSet's shifting policy,
planner settings and status parts in ``shift_policy``, ``gearset_plan`` and ``gearset_status``),
``crdgen`` (models -> CRD YAML) and ``cli`` (``gearshift crds``). Import from the module that holds a
name; this package re-exports nothing.
"""

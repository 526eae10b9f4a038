"""The three custom resources of gearshift as pydantic models, and the CRDs generated from them.

Modules: ``common`` (base configs, conditions and their setter, condition types, event reasons, name
limits), ``gpuprofile``, ``gearset``, ``pdservice`` (one kind each; the GearSet's shifting policy,
planner settings and status parts in ``shift_policy``, ``gearset_plan`` and ``gearset_status``; the
PDService's sections in ``modelspec``, ``rolespec``, ``routerspec`` and ``enginespec``), ``probedoc``
(the probe's document, read by the operator and written by the worker image), ``crdgen`` (models ->
CRD YAML), ``crdcheck`` and ``cli`` (``gearshift crds``). Import from the module that holds a name; this
package re-exports nothing.
"""

"""I/O adapters below the handlers: every client and cache the operator talks to the world through.

The Kubernetes API and its write fence (:mod:`~gearshift.adapters.kube`), Prometheus
(:mod:`~gearshift.adapters.prometheus`), the loops' signal sources (:mod:`~gearshift.adapters.signals`),
the caches of slow reads (:mod:`~gearshift.adapters.caches`), what the operator remembers per object
(:mod:`~gearshift.adapters.memory`), its own metrics (:mod:`~gearshift.adapters.metrics`) and the Lease
(:mod:`~gearshift.adapters.leader`). The pure packages (api, planner, control, k8s, the facts) compute on
what these return and never talk to a server themselves, and these import no handler; the import contracts
in pyproject.toml (``[tool.importlinter]``) check both.
"""

"""I/O adapters below the handlers: the one Prometheus client (:mod:`gearshift.adapters.prometheus`).

The pure packages (api, planner, control, k8s, the facts) compute on what these return and never talk to
a server themselves; the import contract in pyproject.toml (``[tool.importlinter]``) checks it.
"""

"""Test doubles: the in-memory Kubernetes API every handler test runs against (:mod:`.kube`), tiny
programs the sandbox's pod-runner tests run inside pods (:mod:`.servers`), and the manifests of
gearshift's kinds that tests and benchmarks build from the API models (:mod:`.manifests`). Only tests,
benchmarks and the sandbox import this (an import contract in pyproject.toml)."""

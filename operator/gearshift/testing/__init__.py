"""Test doubles: the in-memory Kubernetes API every handler test runs against (:mod:`.kube`), and tiny
programs the sandbox's pod-runner tests run inside pods (:mod:`.servers`). Only tests and the sandbox
import this (an import contract in pyproject.toml)."""

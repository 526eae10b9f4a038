"""Test doubles: tiny programs the sandbox's pod-runner tests run inside pods (:mod:`.servers`). Only
tests and the sandbox import this (an import contract in pyproject.toml)."""

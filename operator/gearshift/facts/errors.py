"""The two input errors every layer raises: a policy value and a setting that cannot be used. Pure.

Both are ``ValueError``s whose message names the offending field, flag or variable and what it must be;
this module imports nothing, so any package may raise them.
"""

from __future__ import annotations


class PolicyError(ValueError):
    """A policy value that cannot be used: a GearSet's ``spec.policy`` (message ``spec.policy.<field>``)
    or a PDService's router policy name or weights (``router.policy``, ``router.weights.<role>.<key>``).
    The message names the field and the fix."""


class SettingsError(ValueError):
    """A setting that cannot be used: a command-line flag (the router's) or an environment variable
    (the probe lifecycle's ``GEARSHIFT_PROBE_*``). The message names it and what it must be."""

"""gearshift: serve LLMs on heterogeneous GPU fleets with unequal pipeline stages and run-time gear shifts."""

__version__ = "0.1.0"

#: API group and version of the custom resources.
GROUP = "gearshift.io"
VERSION = "v1alpha1"

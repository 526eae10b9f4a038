"""The planner's exceptions: bad input, and input that is valid but cannot be planned.

::

    PlanError (ValueError)
     ├── PlanInputError          a profile or layer-cost file with a missing or impossible field
     └── InfeasibleError         valid input that no pipeline can serve
          ├── EmptyFleetError     no node to plan on
          ├── LayerTooLargeError  one layer needs more memory than the largest card holds
          ├── NoLinkError         the nodes that could hold the model are not linked
          ├── ModelTooLargeError  the whole model does not fit the fleet's memory
          └── StageLimitError     the model needs more stages than the caller allows (``max_stages``)
"""

from __future__ import annotations


class PlanError(ValueError):
    """Anything the planner refuses; the message names what is wrong and, where it can, by how much."""


class PlanInputError(PlanError):
    """A resource profile or layer-cost file field that is missing or impossible; names the field."""


class InfeasibleError(PlanError):
    """Valid input for which no pipeline exists."""


class EmptyFleetError(InfeasibleError):
    """The fleet (after filters such as the micro-batch limit) has no node."""


class LayerTooLargeError(InfeasibleError):
    """A single layer's weights plus KV cache exceed every node's memory."""


class NoLinkError(InfeasibleError):
    """Enough memory exists, but the profile lacks (or caps) the links a pipeline would need."""


class ModelTooLargeError(InfeasibleError):
    """The model's weights plus KV cache exceed the memory the fleet can pool in one pipeline."""


class StageLimitError(InfeasibleError):
    """The model fits the fleet only across more stages than ``max_stages`` allows (e.g. one node's memory
    is too small for a gear the engine must run as one stage); names what is needed and what is there."""

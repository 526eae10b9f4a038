"""gearshift.planner: cost model, minimum-bottleneck partitioner, gear generation, pipeline simulator.

Pure code: no network, no kopf, no clock. The operator calls :func:`plan` with a :class:`Profile`
(built from GPUProfiles in FlexPipe's format (docs/sources.md#resource-profile), or read by
:func:`load_cluster`) and a cost model (:func:`load_model`, :class:`RooflineCostModel` from a
:class:`gearshift.facts.model.ModelArch`).
"""

from gearshift.planner.costs import (
    CostModel,
    FileCostModel,
    LayerCosts,
    RooflineAssumptions,
    RooflineCostModel,
    load_model,
    parse_layer_costs,
)
from gearshift.planner.errors import (
    EmptyFleetError,
    InfeasibleError,
    LayerTooLargeError,
    ModelTooLargeError,
    NoLinkError,
    PlanError,
    PlanInputError,
    StageLimitError,
)
from gearshift.planner.gears import Gear, PlanResult, Prediction, Stage, plan
from gearshift.planner.intents import INTENTS
from gearshift.planner.partition import Pipeline, PipelineStage, evaluate, even_split, min_bottleneck
from gearshift.planner.prediction import MixRates
from gearshift.planner.profile import LINK_CAP, Link, Node, Profile, load_cluster, parse_profile
from gearshift.planner.windows import Windows

__all__ = [
    "INTENTS",
    "LINK_CAP",
    "CostModel",
    "EmptyFleetError",
    "FileCostModel",
    "Gear",
    "InfeasibleError",
    "LayerCosts",
    "LayerTooLargeError",
    "Link",
    "MixRates",
    "ModelTooLargeError",
    "NoLinkError",
    "Node",
    "Pipeline",
    "PipelineStage",
    "PlanError",
    "PlanInputError",
    "PlanResult",
    "Prediction",
    "Profile",
    "RooflineAssumptions",
    "RooflineCostModel",
    "Stage",
    "StageLimitError",
    "Windows",
    "evaluate",
    "even_split",
    "load_cluster",
    "load_model",
    "min_bottleneck",
    "parse_layer_costs",
    "parse_profile",
    "plan",
]

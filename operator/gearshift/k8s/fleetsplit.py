"""Split GPU nodes between the prefill and decode roles so that the two never plan on the same cards.

Rule (the team's design decision for PD placement): nodes only one role may use stay with it; nodes both may
use are split per GPU model, by sorted node name, prefill taking ``ceil(n / 2)`` of each model and decode
the rest. Deterministic (the same input gives the same split on every reconcile and every replica of the
operator), and each role keeps a share of every card type both wanted. Pure.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping


def split_pools(
    prefill: Mapping[str, str], decode: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """Split two candidate pools ``{node name: GPU model}`` into disjoint ones.

    Returns:
        ``(prefill_pool, decode_pool)``, each ``{node: gpu model}``, disjoint, whose union is the union of
        the inputs. For a node in both inputs, the prefill input's GPU model names its group.
    """
    both = sorted(set(prefill) & set(decode))
    by_model: dict[str, list[str]] = defaultdict(list)
    for node in both:
        by_model[prefill[node]].append(node)
    to_prefill: set[str] = set()
    for nodes in by_model.values():
        to_prefill.update(nodes[: math.ceil(len(nodes) / 2)])
    shared = set(both)
    p = {n: m for n, m in prefill.items() if n not in shared or n in to_prefill}
    d = {n: m for n, m in decode.items() if n not in shared or n not in to_prefill}
    return p, d

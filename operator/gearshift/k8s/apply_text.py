"""Text to feed ``kubectl apply -f -``: JSON, never YAML.

PyYAML and the API server's YAML reader disagree on scalars such as ``084543``: PyYAML (YAML 1.1 resolver)
sees a string and writes it unquoted, Go's reader (sigs.k8s.io/yaml) reads a number, and a string field
(a taint value, a label) is then refused. JSON has one reading, and kubectl accepts it on stdin.
"""

from __future__ import annotations

import json
from typing import Any


def apply_text(manifests: dict[str, Any] | list[dict[str, Any]]) -> str:
    """One manifest, or many wrapped in a ``v1`` ``List``, as JSON text for ``kubectl apply -f -``."""
    if isinstance(manifests, dict):
        return json.dumps(manifests)
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifests)})

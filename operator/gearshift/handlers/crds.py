"""Start-up check that the installed CRDs hold every field the operator writes.

Thin: reads the three CRDs, asks :func:`gearshift.api.crdcheck.stale_crds`, and stops the operator with a
message that names the missing fields and the fix. Running on would let the API server prune the
operator's writes without a word (the executor state of a GearSet, a forced shift cycling for ever).
"""

from __future__ import annotations

import logging

from gearshift.adapters.kube import CRD, KubeApi, KubeApiError
from gearshift.api import crdcheck
from gearshift.api.crdgen import KINDS

log = logging.getLogger(__name__)


class StaleCRDs(RuntimeError):
    """The installed CRDs lack fields the operator writes; the message names them and the fix."""


def check_installed_crds(api: KubeApi) -> None:
    """Raise :class:`StaleCRDs` when an installed CRD is missing or older than this operator's.

    A 403 (no RBAC to read CRDs) cannot be checked: it is logged as a warning and the operator runs on.

    Raises:
        StaleCRDs: a gap in any of the CRDs (message: :func:`crdcheck.stale_message`).
    """
    installed = {}
    for kind in KINDS:
        try:
            installed[kind.name] = api.get(*CRD, None, kind.name)
        except KubeApiError as exc:
            if exc.status == 403:
                log.warning("cannot read CRD %s to check it is current (%s); running on", kind.name, exc)
                return
            raise
    stale = crdcheck.stale_crds(installed)
    if stale:
        raise StaleCRDs(crdcheck.stale_message(stale))
    log.info("installed CRDs match this operator (%s)", ", ".join(k.name for k in KINDS))

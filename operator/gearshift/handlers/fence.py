"""The write fence: while this replica does not lead, no write of the operator reaches the API server.

#31 item 5: losing the Lease must stop every handler at once (nothing acts without it). kopf's handlers
cannot be cancelled from outside, so the operator re-executes itself on a loss (``gearshift.handlers.main``);
the fence covers the time before that, and a failed re-exec: every write goes through one of two
functions, and both ask :data:`FENCE` first.

- the handlers' own API calls: :meth:`gearshift.handlers.kubeapi.RestKubeApi._call`;
- kopf's: every request kopf makes (its patches of status, finalizers and annotations, its events, its
  watches) goes through ``kopf._cogs.clients.api.request`` (kopf 1.45: ``get``/``post``/``patch``/
  ``delete``/``stream`` in that module look it up by its global name at each call), which
  :func:`install_kopf_fence` wraps once.

A write is any method but GET, HEAD and OPTIONS (watches are GETs): reads cannot act, and a standby may
read. Without ``--leader-elect`` the fence stays open. controller-runtime has no such fence: it exits on
a loss, and its manager stops the runnables on the way ("leader election lost").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from gearshift.handlers.kubeapi import KubeApiError

log = logging.getLogger("gearshift.fence")

#: HTTP methods that change nothing.
READS = frozenset({"GET", "HEAD", "OPTIONS"})


class NotLeader(KubeApiError):
    """A write refused by the fence: this replica does not hold the Lease (``status`` 0: never sent)."""


class Fence:
    """Whether writes may go out: open by default; :meth:`guard` makes a predicate decide, :meth:`close`
    shuts it for good (the process is about to re-execute or exit)."""

    def __init__(self) -> None:
        self._may: Callable[[], bool] | None = None
        self._closed = threading.Event()
        self.refused = 0

    def guard(self, may_act: Callable[[], bool]) -> None:
        """Writes go out only while ``may_act()`` is true (asked at each write)."""
        self._may = may_act

    def close(self) -> None:
        self._closed.set()

    def reset(self) -> None:
        """Open again, unguarded (tests)."""
        self._may = None
        self._closed.clear()
        self.refused = 0

    def allows(self, method: str) -> bool:
        if method.upper() in READS:
            return True
        if self._closed.is_set():
            return False
        may = self._may
        return may is None or may()

    def check(self, method: str, what: str) -> None:
        """Raise :class:`NotLeader` for a write the fence refuses.

        Raises:
            NotLeader: ``method`` writes and this replica may not act.
        """
        if not self.allows(method):
            self.refused += 1
            if self.refused == 1:
                log.warning("not the leader: refused %s %s (and every write until the re-exec)", method, what)
            raise NotLeader(f"{method.upper()} {what}: refused, this replica does not hold the Lease")


FENCE = Fence()


def install_kopf_fence() -> None:
    """Wrap ``kopf._cogs.clients.api.request`` with :data:`FENCE` (idempotent)."""
    from kopf._cogs.clients import api

    original = api.request
    if getattr(original, "_gearshift_fenced", False):
        return

    async def fenced(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        FENCE.check(method, url)
        return await original(method, url, *args, **kwargs)

    fenced._gearshift_fenced = True  # type: ignore[attr-defined]
    api.request = fenced

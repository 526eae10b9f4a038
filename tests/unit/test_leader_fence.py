"""The write fence: while this replica may not act, no write of the operator goes out, through
its own API client or through kopf's; reads still do."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from kopf._cogs.clients import api as kopf_api

from gearshift.adapters.kube import FENCE, KubeApiError, NotLeader, RestKubeApi, install_kopf_fence


@pytest.fixture(autouse=True)
def open_fence() -> Any:
    FENCE.reset()
    yield
    FENCE.reset()


class Client:
    """Just enough of ``kubernetes.client.ApiClient`` for RestKubeApi: records what was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def param_serialize(self, method: str, resource_path: str, **_: Any) -> tuple[Any, ...]:
        return method, resource_path, {}, None, None

    def call_api(self, method: str, url: str, **_: Any) -> Any:
        self.sent.append((method, url))

        class Resp:
            status, reason = 200, "OK"

            def read(self) -> bytes:
                return b'{"items": []}'

        return Resp()


def test_open_by_default_and_guarded_by_the_predicate():
    assert FENCE.allows("POST") and FENCE.allows("patch")
    leading = [True]
    FENCE.guard(lambda: leading[0])
    assert FENCE.allows("PATCH")
    leading[0] = False
    assert not FENCE.allows("PATCH") and not FENCE.allows("delete") and not FENCE.allows("PUT")
    assert FENCE.allows("GET") and FENCE.allows("get") and FENCE.allows("HEAD")  # reads never act
    leading[0] = True
    FENCE.close()  # closed for good: the predicate no longer counts
    assert not FENCE.allows("POST") and FENCE.allows("GET")


def test_rest_kube_api_sends_no_write_while_fenced(caplog: pytest.LogCaptureFixture):
    c = Client()
    kube = RestKubeApi(c)
    FENCE.guard(lambda: False)
    with caplog.at_level(logging.WARNING, logger="gearshift.fence"):
        for write in (
            lambda: kube.apply(
                {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "n"}}
            ),
            lambda: kube.patch_status("apps/v1", "StatefulSet", "n", "s", {"x": 1}),
            lambda: kube.delete("v1", "Pod", "n", "p"),
            lambda: kube.create_event({"metadata": {"namespace": "n"}}),
        ):
            with pytest.raises(NotLeader) as exc:
                write()
            assert isinstance(exc.value, KubeApiError) and exc.value.status == 0
    assert c.sent == []  # nothing reached the client
    assert kube.list("v1", "Pod", "n") == []  # a read goes out
    assert c.sent == [("GET", "/api/v1/namespaces/n/pods")]
    assert FENCE.refused == 4
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "PATCH /api/v1/namespaces/n/services/s" in warned[0], warned  # once


def test_kopf_requests_are_fenced_in_one_place(monkeypatch: pytest.MonkeyPatch):
    sent: list[tuple[str, str]] = []

    async def original(method: str, url: str, **_: Any) -> Any:
        sent.append((method, url))

        class Resp:
            async def __aenter__(self) -> Any:
                return self

            async def __aexit__(self, *_: Any) -> None:
                return None

            async def json(self) -> Any:
                return {"ok": True}

        return Resp()

    monkeypatch.setattr(kopf_api, "request", original)
    install_kopf_fence()
    install_kopf_fence()  # idempotent: wrapped once
    assert kopf_api.request is not original and getattr(kopf_api.request, "_gearshift_fenced", False)
    FENCE.guard(lambda: False)
    settings: Any = None
    log = logging.getLogger("test")

    async def go() -> None:
        # kopf's own helpers (what its patches, finalizers and events use) call request by its global name.
        with pytest.raises(NotLeader):
            await kopf_api.patch(
                "/apis/gearshift.io/v1alpha1/gearsets/x", payload={}, settings=settings, logger=log
            )
        with pytest.raises(NotLeader):
            await kopf_api.post("/api/v1/namespaces/n/events", payload={}, settings=settings, logger=log)
        with pytest.raises(NotLeader):
            await kopf_api.delete("/api/v1/pods/x", settings=settings, logger=log)
        assert sent == []
        assert await kopf_api.get("/version", settings=settings, logger=log) == {"ok": True}
        FENCE.guard(lambda: True)
        assert await kopf_api.patch("/x", payload={}, settings=settings, logger=log) == {"ok": True}

    asyncio.run(go())
    assert sent == [("get", "/version"), ("patch", "/x")]

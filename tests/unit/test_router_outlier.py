"""gearshift.router.outlier against Envoy's documented semantics (outlier_detection.proto, health_check.proto,
the panic threshold), on plain host records."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gearshift.router import outlier as O


@dataclass(eq=False)
class H:
    healthy: bool = True
    check_failures: int = 0
    check_passes: int = 0
    failures: int = 0
    ejected_until: float = 0.0
    ejections: int = 0
    returned_at: float = 0.0


CFG = O.OutlierConfig()


def errors(h: H, n: int, now: float, peers: list[H]) -> list[bool]:
    return [O.record_error(h, now, peers, CFG) for _ in range(n)]


def test_envoy_defaults() -> None:
    # outlier_detection.proto: consecutive_5xx 5, interval 10 s, base_ejection_time 30 s,
    # max_ejection_time 300 s, max_ejection_percent 10; load balancing: healthy_panic_threshold 50 %.
    assert (CFG.consecutive_errors, CFG.interval_s, CFG.base_ejection_s, CFG.max_ejection_s) == (
        5,
        10,
        30,
        300,
    )
    assert (CFG.max_ejection_percent, CFG.panic_threshold_percent) == (10, 50)


def test_fifth_consecutive_error_ejects_and_a_success_resets_the_run() -> None:
    h, other = H(), H()
    peers = [h, other]
    assert errors(h, 4, 0.0, peers) == [False] * 4
    O.record_success(h)
    assert errors(h, 4, 1.0, peers) == [False] * 4
    assert O.record_error(h, 1.0, peers, CFG) is True
    assert h.ejected_until == 31.0 and h.ejections == 1
    assert not O.available(h, 30.9) and O.available(h, 31.0)


def test_ejection_time_grows_with_each_ejection_up_to_the_maximum() -> None:
    h, other = H(), H()
    now = 0.0
    spans = []
    for _ in range(12):
        errors(h, 5, now, [h, other])
        spans.append(h.ejected_until - now)
        now = h.ejected_until
        O.release_expired([h], now)  # back in service, and at once failing again: no decay
    assert spans == [30, 60, 90, 120, 150, 180, 210, 240, 270, 300, 300, 300]


def test_multiplier_decays_one_per_interval_in_service() -> None:
    h, other = H(), H()
    errors(h, 5, 0.0, [h, other])
    O.release_expired([h], 30.0)
    errors(h, 5, 40.0, [h, other])  # 10 s in service since 30: 1 → 0, then the new ejection → 1
    assert h.ejections == 1 and h.ejected_until == 70.0
    O.release_expired([h], 70.0)
    errors(h, 5, 75.0, [h, other])  # 5 s: no decay, 1 → 2
    assert h.ejections == 2 and h.ejected_until == 135.0


@pytest.mark.parametrize(("n", "cap"), [(1, 1), (2, 1), (9, 1), (10, 1), (20, 2), (35, 3)])
def test_at_most_max_ejection_percent_but_at_least_one(n: int, cap: int) -> None:
    hosts = [H() for _ in range(n)]
    for h in hosts:
        errors(h, 5, 0.0, hosts)
    assert sum(O.ejected(h, 0.0) for h in hosts) == cap


def test_panic_below_half_routes_to_all() -> None:
    hosts = [H() for _ in range(4)]
    assert O.routable(hosts, 0.0, CFG) == ([0, 1, 2, 3], False)
    hosts[0].healthy = False
    hosts[1].ejected_until = 10.0
    assert O.routable(hosts, 0.0, CFG) == ([2, 3], False)  # 50 % is not below 50 %
    hosts[2].healthy = False
    assert O.routable(hosts, 0.0, CFG) == ([0, 1, 2, 3], True)
    assert O.routable(hosts, 0.0, O.OutlierConfig(panic_threshold_percent=0)) == ([3], False)
    assert O.routable([], 0.0, CFG) == ([], False)


def test_active_checks_thresholds_and_uneject() -> None:
    h = H()
    for _ in range(2):
        O.record_check(h, False, 0.0, CFG)
    assert h.healthy  # unhealthy_threshold 3
    O.record_check(h, False, 0.0, CFG)
    assert not h.healthy
    O.record_check(h, True, 1.0, CFG)
    assert not h.healthy  # healthy_threshold 2
    O.record_check(h, False, 1.0, CFG)
    O.record_check(h, True, 2.0, CFG)
    assert not h.healthy  # a failure in between restarts the count
    O.record_check(h, True, 3.0, CFG)
    assert h.healthy
    # successful_active_health_check_uneject_host: a passing check ends an ejection
    h.ejected_until, h.failures = 100.0, 3
    O.record_check(h, True, 4.0, CFG)
    assert O.available(h, 4.0) and h.failures == 0 and h.returned_at == 4.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("consecutive_errors", -1),
        ("unhealthy_threshold", 0),
        ("check_timeout_s", 0),
        ("panic_threshold_percent", 101),
    ],
)
def test_bad_thresholds_name_the_field(field: str, value: float) -> None:
    with pytest.raises(O.OutlierConfigError, match=field) as exc:
        O.OutlierConfig(**{field: value})
    assert exc.value.field == field


def test_zero_consecutive_errors_disables_ejection() -> None:
    h = H()
    cfg = O.OutlierConfig(consecutive_errors=0)
    assert not any(O.record_error(h, 0.0, [h, H()], cfg) for _ in range(50))

"""The sandbox harness's pure helpers: polling and periodic sampling."""

import itertools
import time

import pytest

from gearshift.dev.sandbox.harness import Periodic, wait_until


def test_wait_until_returns_the_first_truthy_value():
    calls = itertools.count(1)
    assert wait_until(lambda: (n := next(calls)) >= 3 and n, 5, "the third call", interval_s=0.01) == 3


def test_wait_until_names_what_it_waited_for():
    with pytest.raises(TimeoutError, match="waiting for the moon"):
        wait_until(lambda: None, 0.05, "the moon", interval_s=0.01)


def test_periodic_keeps_samples_in_order_and_counts_errors():
    n = itertools.count()

    def sample() -> int:
        i = next(n)
        if i == 1:
            raise RuntimeError("a slow API server")
        return i

    p = Periodic(sample, 0.01)
    p.start()
    deadline = time.monotonic() + 5
    while len(p.samples) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    p.stop()
    assert p.samples[:4] == [0, 2, 3, 4] and p.errors == 1
    after = len(p.samples)
    time.sleep(0.05)
    assert len(p.samples) == after  # stopped means stopped

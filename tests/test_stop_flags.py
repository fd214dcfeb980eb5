"""The stop flag that the ranks of a data-parallel job agree on (jobrun.signals): what one
rank's SIGINT/SIGTERM becomes, what the sum over ranks decides, and the grace after
which a rank stops where it is. (The processes themselves: tests/test_elastic.py.)"""

from __future__ import annotations

import _thread
import signal
import time

import pytest
from runner_util import HANG_S

from jobrun import signals
from jobrun.errors import Interrupted


@pytest.fixture(autouse=True)
def clean():
    signals.reset()
    yield
    signals.reset()


def test_nothing_requested_nothing_agreed():
    assert signals.requested() == 0 and signals.flag() == 0.0
    signals.agree(0.0)  # no rank was signalled: every rank goes on


def test_a_signal_waits_for_the_agreement_then_its_grace_ends(monkeypatch):
    fired: list[int] = []
    monkeypatch.setattr(signals, "GRACE_S", 0.05)
    monkeypatch.setattr(_thread, "interrupt_main", lambda signum: fired.append(signum))
    assert signals.request(signal.SIGINT) is False  # remembered, for the next agreement
    assert signals.requested() == signal.SIGINT and signals.flag() == 1.0
    assert signals.request(signal.SIGINT) is False  # a second Ctrl-C (the launcher's) within it
    deadline = time.monotonic() + HANG_S
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fired == [signal.SIGINT]  # the grace is over: the handler runs again ...
    assert signals.request(signal.SIGINT) is True  # ... and now stops where it is


def test_every_rank_stops_with_the_same_signal():
    # One rank got SIGINT, another SIGTERM: summed, the flags say SIGTERM to every rank.
    signals.request(signal.SIGINT)
    one = signals.flag()
    signals.reset()
    signals.request(signal.SIGTERM)
    other = signals.flag()
    with pytest.raises(Interrupted) as e:
        signals.agree(one + other)
    assert e.value.exit_code == 143
    assert signals.requested() == 0  # acted on: nothing left for the next agreement
    with pytest.raises(Interrupted) as e:
        signals.agree(3 * one)  # three ranks got SIGINT (one Ctrl-C, forwarded or not)
    assert e.value.exit_code == 130

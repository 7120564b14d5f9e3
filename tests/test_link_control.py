"""The range controller (feedpipe/_helpers/link_control.py) fed synthetic completions from a
simulated link (a round trip before each first byte, the node's bandwidth shared by the
responses under way, optionally a cap per response): it settles near bandwidth x RTT / range
requests in flight on an uncapped link and on more where each response is capped, never leaves
``[floor, ceiling]``, and its gate never lets more than the target in flight."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feedpipe._helpers.link_control import Gate, LinkController

MB = 1 << 20


def simulate(control: LinkController, rtt: float, node: float, cap: float | None, size: int,
             n: int = 300, seed: int = 0, demand: int | None = None) -> int:
    """Fetch ``n`` ranges of ``size`` bytes over the link, keeping the controller's target (or
    ``demand``, when less) in flight, in steps of 1 ms of simulated time; the most in flight."""
    rnd = random.Random(seed)
    t, delivered, done, most, dt = 0.0, 0.0, 0, 0, 0.001
    under_way: list[list[float]] = []  # [first byte at, bytes left, delivered at start, start]
    while done < n:
        want = control.target if demand is None else min(control.target, demand)
        while len(under_way) < want:
            under_way.append([t + rtt * rnd.uniform(0.7, 1.3), size, delivered, t])
        most = max(most, len(under_way))
        moving = [r for r in under_way if t >= r[0]]
        if moving:
            rate = min(cap or node, node / len(moving))
            for r in moving:
                r[1] -= rate * dt
                delivered += rate * dt
        t += dt
        for r in [r for r in under_way if r[1] <= 0]:
            under_way.remove(r)
            done += 1
            control.complete(size, t - r[3], int(delivered - r[2]), inflight=len(under_way) + 1,
                             now=t)
    return most


def littles(rtt: float, node: float, cap: float | None, size: int) -> float:
    """The requests in flight that fill the link: bandwidth x RTT over a range's bytes, plus the
    ranges streaming at once (one where a response may take the whole bandwidth)."""
    return node * rtt / size + (node / cap if cap else 1)


def test_an_uncapped_link_settles_near_bandwidth_times_rtt() -> None:
    for rtt, size in ((0.1, 4 * MB), (0.03, MB), (0.1, MB)):
        c = LinkController(floor=2, ceiling=64, start=4)
        simulate(c, rtt, 200e6, None, size)
        need = littles(rtt, 200e6, None, size)
        assert need * 0.8 <= c.target <= need * 1.6 + 2, (rtt, size, c.target, need)
        assert not c.startup  # it found the link full and left its doubling
        assert 150e6 <= c.bw <= 210e6


def test_a_capped_link_gets_more_streams_than_an_uncapped_one() -> None:
    capped = LinkController(floor=2, ceiling=64, start=4)
    simulate(capped, 0.03, 200e6, 25e6, 4 * MB)
    plain = LinkController(floor=2, ceiling=64, start=4)
    simulate(plain, 0.03, 200e6, None, 4 * MB)
    need = littles(0.03, 200e6, 25e6, 4 * MB)  # 8 streams at the cap, and the round trips
    assert need * 0.9 <= capped.target <= need * 1.6 + 2
    assert capped.target >= 2 * plain.target
    assert capped.stream_bw <= 25e6 * 1.01  # it saw the cap: no response streamed faster


def test_the_ceiling_holds_where_the_link_needs_more() -> None:
    c = LinkController(floor=2, ceiling=6, start=4)
    most = simulate(c, 0.03, 200e6, 5e6, MB)  # 40 capped streams would be needed
    assert c.target == 6 and most == 6


def test_a_reader_asking_for_less_does_not_pin_the_target_down() -> None:
    c = LinkController(floor=2, ceiling=64, start=8)
    simulate(c, 0.03, 200e6, 25e6, 4 * MB, n=100, demand=3)
    # never judged the link full from 3 requests: still doubling, with room above them
    assert c.startup and c.target >= 2 * 3
    simulate(c, 0.03, 200e6, 25e6, 4 * MB, n=300)  # the reader asks for all it may
    assert c.target >= littles(0.03, 200e6, 25e6, 4 * MB) * 0.9


def test_equal_floor_and_ceiling_fix_the_number() -> None:
    c = LinkController(floor=5, ceiling=5)
    assert simulate(c, 0.1, 200e6, None, 4 * MB, n=50) == 5 and c.target == 5


completion = st.tuples(st.integers(-10, 1 << 30), st.floats(-1.0, 100.0, allow_nan=False),
                       st.integers(-10, 1 << 34), st.integers(0, 300),
                       st.none() | st.floats(-1.0, 1e6, allow_nan=False))


@settings(max_examples=300, deadline=None)
@given(floor=st.integers(-3, 70), ceiling=st.integers(-3, 70),
       start=st.none() | st.integers(-5, 100), events=st.lists(completion, max_size=200))
def test_the_target_stays_within_floor_and_ceiling(floor: int, ceiling: int, start: int | None,
                                                   events: list) -> None:  # type: ignore[type-arg]
    c = LinkController(floor=floor, ceiling=ceiling, start=start)
    lo, hi = c.floor, c.ceiling
    assert 1 <= lo <= hi == max(1, ceiling)
    assert lo <= c.target <= hi
    for nbytes, seconds, delivered, inflight, now in events:
        c.complete(nbytes, seconds, delivered, inflight=inflight, now=now)
        assert lo <= c.target <= hi and isinstance(c.target, int)


def test_the_gate_never_lets_more_than_the_target_in_flight() -> None:
    control = LinkController(floor=1, ceiling=64, start=3)
    gate = Gate(control)
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def fetch(k: int) -> None:
        for _ in range(20):
            ticket = gate.enter()
            with lock:
                seen.append((gate.inflight, control.target))
            gate.leave(ticket, 1000 + k)

    threads = [threading.Thread(target=fetch, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(seen) == 240 and gate.inflight == 0
    assert all(inflight <= target for inflight, target in seen)
    assert 1 <= gate.most <= 64 and control.completions == 240


SAY = """
import logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
from feedpipe._helpers import storage
storage._executor()
storage._executor()
"""


@pytest.mark.parametrize(("env", "said"), [
    ({}, "follow the link between 2 and 32"),
    ({"FEEDPIPE_REMOTE_STREAMS": "6", "FEEDPIPE_REMOTE_STREAMS_MIN": "6"}, "fixed at 6"),
    ({"FEEDPIPE_REMOTE_STREAMS": "64", "FEEDPIPE_REMOTE_STREAMS_MIN": "4"},
     "follow the link between 4 and 64")])
def test_the_choice_of_streams_is_said_once(env: dict[str, str], said: str) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FEEDPIPE_REMOTE_STREAMS")}
    out = subprocess.run([sys.executable, "-c", SAY], capture_output=True, text=True, timeout=120,
                         env=base | env | {"PYTHONPATH": str(Path(__file__).parent.parent)})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [x for x in out.stderr.splitlines() if "range requests in flight" in x]
    assert len(lines) == 1 and said in lines[0], out.stderr[-2000:]

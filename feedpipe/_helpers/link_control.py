"""How many range requests a process keeps in flight: as many as the link needs, measured.

A link is full when the bytes in flight cover its bandwidth times the time one request takes
unloaded (Little's law: requests in flight = requests/s x seconds per request). That time is the
round trip before the first byte plus the range's bytes at what one response streams: on a link
where one response may take the whole bandwidth it is about one round trip and one range's
transfer, and bandwidth x RTT / range bytes + 1 requests suffice; where the store caps each
response (tens of MB/s), each range takes range / cap, and the link needs bandwidth / cap
streams more. Neither the bandwidth nor the cap is known in advance, so the controller measures
them as ranges complete, after the design of BBR (a congestion controller of TCP):

- ``bw``: the highest delivery rate seen recently; each completion gives a sample, the bytes
  delivered while it was under way over its duration, or, where that is less, the bytes of the
  last two rounds of completions over their time (a range counts all its bytes when it
  completes, and completions come in bursts where the client's thread was busy: a short
  interval would count bytes that arrived before it).
- ``d_min``: the shortest duration of a full-sized range (the quickest a range was served);
  ``rtt``: the shortest response of any size, a bound on the round trip.
- The target is ``gain x bw x d_min / range bytes``, clamped to ``[floor, ceiling]``.

**Startup**: ``gain`` 2, so each round (a target's worth of completions) the target doubles for
as long as the measured bandwidth grows with it: more streams while capped responses add
bandwidth. When the bandwidth has not grown by a quarter over three rounds, the link is full:
``gain`` becomes 1.25 (a quarter of headroom), which shrinks the target to what the measured
bandwidth needs; a later rise of a quarter over the plateau (the link got faster) starts the
doubling again. A sample taken while fewer requests were in flight than the target (the reader
asked for less) can raise ``bw`` but never ends startup, so a slow reader does not pin the
target down.
"""

from __future__ import annotations

import math
import threading
from collections import deque

STARTUP_GAIN = 2.0
STEADY_GAIN = 1.25
PLATEAU = 1.25  # bandwidth growth per three rounds that keeps startup going
PLATEAU_ROUNDS = 3


class LinkController:
    """The number of requests to keep in flight, from the completions it is told of.

    Pure logic: :meth:`complete` with what a finished request measured, :attr:`target` for
    how many may be in flight now. Not thread-safe by itself (the caller holds a lock).

    Example:
        >>> c = LinkController(floor=2, ceiling=32, start=4)
        >>> for _ in range(40):  # made-up completions: ranges of 1 MiB that each took 0.1 s
        ...     c.complete(1 << 20, 0.1, 4 << 20, inflight=c.target)
        >>> 2 <= c.target <= 32 and c.rtt == 0.1
        True
    """

    def __init__(self, floor: int = 2, ceiling: int = 32, start: int | None = None) -> None:
        self.ceiling = max(1, ceiling)
        self.floor = max(1, min(floor, self.ceiling))
        self.target = self._clamp(start if start is not None else 4)
        self.gain = STARTUP_GAIN
        self.startup = True
        self.bw = 0.0  # bytes/s: the windowed maximum delivery rate
        self.rtt = math.inf  # seconds: the shortest response seen
        self.d_min = math.inf  # seconds: the shortest full-sized range
        self.size = 0.0  # bytes: a full-sized range (the largest seen recently)
        self.stream_bw = 0.0  # bytes/s: the most one response streamed
        self.completions = 0
        self._rates: deque[float] = deque()  # recent delivery-rate samples
        self._ends: deque[tuple[float, int]] = deque()  # (time, bytes) of recent completions
        self._round_end = self.target  # completions at which the current round ends
        self._plateau_bw = 0.0  # bw at the last round that grew it by PLATEAU
        self._flat_rounds = 0

    def _clamp(self, n: float) -> int:
        if math.isnan(n):  # (inf x 0: a response of no measurable duration)
            return self.floor
        return self.ceiling if n >= self.ceiling else max(self.floor, math.ceil(n))

    def complete(self, nbytes: int, seconds: float, delivered: int, *, inflight: int,
                 now: float | None = None) -> None:
        """A request answered ``nbytes`` in ``seconds``; ``delivered``: the bytes all requests
        of the process delivered while it was under way (its own included); ``inflight``: the
        requests in flight when it ended (itself included); ``now``: the clock when it ended
        (None: the delivery rate is taken from ``delivered`` alone)."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = max(delivered, nbytes) / seconds
        if now is not None:
            rate = min(rate, self._round_rate(now, nbytes, max(8, 2 * inflight)))
        self.completions += 1
        self.rtt = min(self.rtt, seconds)
        if nbytes > self.size:  # a larger range: the earlier shortest full-sized one is not
            self.size, self.d_min = float(nbytes), seconds
        elif nbytes * 2 >= self.size:
            self.d_min = min(self.d_min, seconds)
        self.stream_bw = max(self.stream_bw, nbytes / seconds)
        limited = inflight < self.target  # the reader asked for fewer than the target
        if not limited or rate > self.bw:
            self._rates.append(rate)
            while len(self._rates) > max(8, 4 * self.target):
                self._rates.popleft()
            self.bw = max(self._rates)
        if self.completions >= self._round_end:
            self._end_round(limited)
        need = self.bw * self.d_min / self.size  # Little's law: requests that fill the link
        self.target = self._clamp(max(self.gain * need, 1.0))

    def _round_rate(self, now: float, nbytes: int, k: int) -> float:
        """The bytes of the last ``k`` completions (this one included) over the time since the
        one before them; infinite until there were that many."""
        self._ends.append((now, nbytes))
        while len(self._ends) > k + 1:
            self._ends.popleft()
        if len(self._ends) <= k or now <= self._ends[0][0]:
            return math.inf
        return sum(b for _, b in list(self._ends)[1:]) / (now - self._ends[0][0])

    def _end_round(self, limited: bool) -> None:
        self._round_end = self.completions + max(1, self.target)
        if self.bw >= self._plateau_bw * PLATEAU:
            self._plateau_bw, self._flat_rounds = self.bw, 0
            if not self.startup:  # the link got faster: find its new bandwidth
                self.startup, self.gain = True, STARTUP_GAIN
            return
        if limited:
            return
        self._flat_rounds += 1
        if self.startup and self._flat_rounds >= PLATEAU_ROUNDS:
            self.startup, self.gain = False, STEADY_GAIN

    def figures(self) -> dict[str, float]:
        """What the controller measured: its target, the link's bandwidth, shortest response
        and the most one response streamed (0 before the first completion)."""
        return {"target": self.target, "bandwidth": self.bw,
                "rtt": 0.0 if math.isinf(self.rtt) else self.rtt,
                "stream_bandwidth": self.stream_bw}


class Gate:
    """The requests of a process in flight, held to a :class:`LinkController`'s target.

    :meth:`enter` waits for a place (first come, first served) and gives a ticket;
    :meth:`leave` hands the place back with the bytes the request brought (0: it failed, and
    measures nothing).

    Example:
        >>> g = Gate(LinkController(floor=1, ceiling=4, start=2))
        >>> t = g.enter(); g.inflight
        1
        >>> g.leave(t, 100); g.inflight, g.most
        (0, 1)
    """

    def __init__(self, control: LinkController, clock: object = None) -> None:
        import time

        self.control = control
        self.clock = clock if callable(clock) else time.monotonic
        self.cond = threading.Condition()
        self.inflight = 0
        self.most = 0
        self.delivered = 0

    def enter(self) -> tuple[float, int]:
        with self.cond:
            while self.inflight >= self.control.target:
                self.cond.wait()
            self.inflight += 1
            self.most = max(self.most, self.inflight)
            return self.clock(), self.delivered

    def leave(self, ticket: tuple[float, int], nbytes: int) -> None:
        with self.cond:
            self.delivered += max(0, nbytes)
            if nbytes > 0:
                now = self.clock()
                self.control.complete(nbytes, now - ticket[0], self.delivered - ticket[1],
                                      inflight=self.inflight, now=now)
            self.inflight -= 1
            # the longest waiters first (a Condition wakes in the order they waited), as many
            # as there are places: the ranges asked for first are fetched first
            self.cond.notify(max(1, self.control.target - self.inflight))

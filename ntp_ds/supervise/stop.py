"""SIGINT and SIGTERM in a worker: stop the job cleanly at a step every rank agrees on; a second signal stops now.

The first signal only records the request; the Trainer asks `should_stop(step)` after every completed step. With
the job's store the ranks agree through it (`ntp_ds.control.job`): the first rank that sees a request proposes to
stop after the next step, and every rank stops there, so all of them hold the same completed step (then they write
its weights, a `run_stopped` event and the summary, and exit with 128 + the signal's number). A rank that got no
signal itself learns of the stop from the store. Without a store each rank stops after the step it is in.

Signals are read by a thread from Python's wakeup file descriptor, so a second signal is acted on at once even
while the main thread is blocked in a collective. A signal that arrives within `DUPLICATE_S` of the first is the
same request delivered twice (a terminal sends Ctrl-C to the launcher and its workers, and the launcher passes it
on; a scheduler may signal every process of the job), not a second one.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from ntp_ds.control.job import propose_stop, publish_step, read_stop

log = logging.getLogger("ntp_ds.train")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
DUPLICATE_S = 1.0
"""A signal within this many seconds of the first one repeats the first request."""


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """The stop requests of one rank and the step at which the job stops."""

    def __init__(self, store=None, *, clock: Callable[[], float] = time.monotonic,
                 exit_now: Callable[[int], None] = os._exit):
        self.store, self._clock, self._exit_now = store, clock, exit_now
        self.requested: int | None = None
        """Number of the first signal this rank received, if any."""
        self.signal: int | None = None
        """Number of the signal the job stops for, once a stop is decided."""
        self._first_at = 0.0
        self._previous: dict = {}
        self._wakeup: tuple[int, int] | None = None

    # -- signals -----------------------------------------------------------------------------------------------
    def install(self) -> StopSignals:
        """Catch SIGINT and SIGTERM in this process (call from the main thread)."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, lambda *_: None)  # the wakeup descriptor does the work
        self._previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._wakeup = (r, w)
        threading.Thread(target=self._watch, args=(r,), name="ntp-stop-signals", daemon=True).start()
        return self

    def uninstall(self) -> None:
        if self._wakeup is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        os.close(self._wakeup[1])  # ends the watcher thread
        self._wakeup = None

    def _watch(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                self.receive(signum)

    def receive(self, signum: int) -> None:
        """Take one signal: the first asks for a clean stop, a later one (after DUPLICATE_S) stops this process."""
        now = self._clock()
        if self.requested is None:
            self.requested, self._first_at = signum, now
            log.warning("%s received: stopping after the step in flight, once every rank has completed it (a second "
                        "signal stops at once)", signal_name(signum))
        elif now - self._first_at >= DUPLICATE_S:
            print(f"{signal_name(signum)} received again: stopping at once", file=sys.stderr, flush=True)
            self._exit_now(128 + signum)

    # -- agreement ---------------------------------------------------------------------------------------------
    def should_stop(self, completed: int, publish: bool = False) -> bool:
        """Whether the job stops now that this rank has completed step `completed` (`publish`: also tell the
        store the step, as the writer does)."""
        if self.store is None:
            if self.requested is not None:
                self.signal = self.requested
            return self.signal is not None
        if publish:
            publish_step(self.store, completed)
        decision = read_stop(self.store)
        if decision is None and self.requested is not None:
            decision = propose_stop(self.store, completed + 1, self.requested)
        if decision is None or completed < decision.after:
            return False
        self.signal = decision.signal
        return True

    @property
    def exit_code(self) -> int:
        """128 + the signal's number once the job stopped for one (130 for SIGINT, 143 for SIGTERM), else 0."""
        return 128 + self.signal if self.signal is not None else 0

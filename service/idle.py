"""Work the engine thread does while no request waits.

Owns: :class:`IdleJob` -- pausable steps (``evospec/decoding/pausable.py``), a name for the logs
and ``/admin/state``, and what to do with their result -- with the driver's side of the protocol:
:meth:`IdleJob.step` runs one step, or brings the steps to a clean point (nothing of theirs
suspended on the model) before the engine serves a request or runs a control call;
:meth:`IdleJob.close` ends them. The engine (``service/engine.py``) advances its job only
while its queue is empty and no request runs, and serves the decoder ``done`` returns from then
on; a job that raises is logged and dropped, and the engine goes on serving what it served.

What runs here: ``--method auto`` timing its candidates (or ``--tree auto`` its shapes) on a
server's first start on a machine (``evospec/assembly.py: Deferred``), so that the server answers
from its first second.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from evospec.decoding.methods import Decoder
from evospec.decoding.pausable import Steps

NEW, WORKING, PAUSED, OVER = "new", "working", "paused", "over"
log = logging.getLogger("evospec.service.engine")


@dataclass
class IdleJob:
    name: str  # what the logs and /admin/state call it
    steps: Steps[Any]
    done: Callable[[Any], Decoder | None]  # the steps' result -> the decoder to serve (None: keep)
    state: str = NEW  # NEW, WORKING (suspended between two pieces of work), PAUSED (clean) or OVER
    chosen: Decoder | None = None  # what ``done`` returned, once OVER

    def step(self, pause: bool, serving: str) -> bool:
        """Run the steps to their next yield -- or, with ``pause``, to a clean point (a no-op
        where they are at one) --; True once they are over: returned (``chosen`` is then what
        ``done`` made of their result) or failed (logged with the method still ``serving``)."""
        if pause and self.state != WORKING:
            return False
        try:
            if self.state == NEW:
                next(self.steps)
            else:
                self.steps.send(pause)
            self.state = PAUSED if pause else WORKING
            return False
        except StopIteration as stop:
            self.state = OVER
            self.chosen = self._finish(stop.value, serving)
        except Exception:
            self.state = OVER
            self.close()
            log.exception("engine: %s failed; serving %s as before", self.name, serving)
        return True

    def _finish(self, result: Any, serving: str) -> Decoder | None:
        try:
            return self.done(result)
        except Exception:
            log.exception("engine: %s could not finish; serving %s as before", self.name, serving)
            return None

    def close(self) -> None:
        """End the steps (their ``finally`` blocks run: decoders they built are released)."""
        self.steps.close()

"""How ``phalanx local`` watches the master: its HTTP API, polled for the job and its new events."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from phalanx.api import views


class SeenEvent(views.EventView):
    """An event of the job and ``at``: when ``phalanx local`` saw it (its console's clock)."""

    at: float


@dataclass
class Poll:
    """One look at the master: whether it answered, whether it answers again after it did not, and the
    events it logged since the previous look."""

    up: bool
    back: bool = False
    events: list[SeenEvent] = field(default_factory=list)


class MasterWatch:
    def __init__(self) -> None:
        self.http: httpx.Client | None = None
        self.events_seq = 0
        self.events: list[SeenEvent] = []
        """Every event seen."""
        self.job: views.JobView | None = None
        """The master's newest ``/v1/job`` (None until it first answered)."""
        self.down_since: float | None = None

    def open(self, *, http_addr: str, token: str) -> None:
        self.http = httpx.Client(
            base_url=f"http://{http_addr}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=2.0,
        )

    def close(self) -> None:
        if self.http is not None:
            self.http.close()

    def _get(self, path: str) -> Any:
        assert self.http is not None
        resp = self.http.get(path)
        resp.raise_for_status()
        return resp.json()

    def poll(self, clock: Callable[[], float]) -> Poll:
        """Reads the job and the new events, each stamped with ``at``: the ``clock`` when it was read."""
        try:
            job = views.JobView.model_validate(self._get("/v1/job"))
            batch = views.EventsPage.model_validate(self._get(f"/v1/events?since={self.events_seq}"))
        except (httpx.HTTPError, ValueError):  # pydantic's ValidationError is a ValueError
            if self.down_since is None:
                self.down_since = clock()
            return Poll(up=False)
        self.job = job
        back = self.down_since is not None
        self.down_since = None
        new = []
        for ev in batch.events:
            self.events_seq = max(self.events_seq, ev.seq)
            event = SeenEvent(**ev.model_dump(), at=clock())
            self.events.append(event)
            new.append(event)
        return Poll(up=True, back=back, events=new)

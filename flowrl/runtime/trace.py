"""The run's timeline as a Chrome trace (open in https://ui.perfetto.dev or chrome://tracing).

One track per pool rank and one for the controller; every plan item a slice named as in
`flowrl plan` and `flowrl render --plan`, with its step and batch rows.
"""

import json
from pathlib import Path

import attrs


@attrs.define
class Slice:
    """One item's run on one rank (or the controller), for timing and the trace."""

    name: str
    kind: str
    track: str  # "controller" or "<pool>/rank<k>"
    start: float
    end: float
    rows: int = 0


class Trace:
    def __init__(self):
        self.events: list[dict] = []
        self.tracks: dict[str, int] = {"controller": 0}

    def add(self, slices, step: int) -> None:
        for s in slices:
            tid = self.tracks.setdefault(s.track, len(self.tracks))
            self.events.append(
                {
                    "name": s.name,
                    "cat": s.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": tid,
                    "ts": s.start * 1e6,
                    "dur": max(s.end - s.start, 0.0) * 1e6,
                    "args": {"step": step, "rows": s.rows},
                }
            )

    def write(self, path: Path) -> None:
        names = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": track}}
            for track, tid in self.tracks.items()
        ]
        temp = Path(path).with_suffix(".tmp")
        temp.write_text(json.dumps({"traceEvents": names + self.events}))
        temp.replace(path)

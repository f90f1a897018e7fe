"""Reading the microbenchmark's JSON lines and checking them, so that a truncated or foreign
file is refused with the line that is wrong rather than half-read."""

from __future__ import annotations

import json

# The measurements the program knows (csrc/microbench/cli.h), in the order `all` runs them;
# M8 comes from the tma-profile subcommand, under ncu.
IDS = ("M9", "M1", "M2", "M3", "M4", "M5", "M6", "M10", "M8")
ALL = ("M9", "M1", "M2", "M3", "M4", "M5", "M6", "M10")  # what `all` prints


class Lines:
    """The device line and every measurement line, grouped by measurement id."""

    def __init__(self, device: dict, records: dict[str, list[dict]]):
        self.device = device
        self.records = records

    def failed(self) -> list[dict]:
        """Lines whose kernel had a wait that ran out (or a wrong result): "ok" false."""
        return [r for rs in self.records.values() for r in rs if r.get("ok") is False]

    def missing(self) -> list[str]:
        """Measurements of `all` with no line."""
        return [m for m in ALL if not self.records.get(m)]


def parse(text: str, source: str = "<lines>") -> Lines:
    """The lines of one run. Raises ValueError naming the line that is not a JSON object, lacks
    "m", names an unknown measurement, or comes before the device line."""
    device = None
    records: dict[str, list[dict]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}:{number}: not a JSON line ({e.msg}): {line[:80]!r}") from None
        if not isinstance(record, dict) or "m" not in record:
            raise ValueError(f"{source}:{number}: a line must be a JSON object with \"m\" (its measurement)")
        m = record["m"]
        if m == "device":
            if device is not None:
                raise ValueError(f"{source}:{number}: a second device line (two runs in one file?)")
            device = record
            continue
        if device is None:
            raise ValueError(f"{source}:{number}: a measurement line before the device line")
        if m not in IDS:
            raise ValueError(f"{source}:{number}: unknown measurement {m!r} (known: {', '.join(IDS)})")
        records.setdefault(m, []).append(record)
    if device is None:
        raise ValueError(f"{source}: no device line: the program did not start on a GPU (see its stderr)")
    return Lines(device, records)


def read(path: str) -> Lines:
    with open(path, encoding="utf-8") as f:
        return parse(f.read(), path)

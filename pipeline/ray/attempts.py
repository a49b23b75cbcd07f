"""The run-attempt records of the ``train`` stage on Ray: which earlier runs of an identity are
in Ray's storage, what the driver recorded of each (``sat_run.json``), and which one an
invocation continues, reuses or starts."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.ray.storage import Storage

__all__ = ["RUN_RECORD", "Attempt", "attempts", "choose_run", "say", "write_record"]


RUN_RECORD = "sat_run.json"  # in a run's storage folder: its identity, status, checkpoint


@dataclass(frozen=True)
class Attempt:
    """One earlier run of an identity in Ray's storage, with what the driver recorded of it."""

    number: int
    folder: Storage  # <storage>/<name>
    record: dict[str, Any]  # RUN_RECORD's content, {} when unreadable

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def checkpoint(self) -> Storage | None:
        """The final checkpoint of a finished run that is still in storage, else None."""
        relative = self.record.get("checkpoint")
        if self.record.get("status") != "FINISHED" or not relative:
            return None
        path = self.folder.child(*Path(relative).parts)
        return path if path.is_dir() else None


def attempts(storage: Storage, base: str) -> list[Attempt]:
    """The runs called ``<base>-<n>`` under ``storage``, by attempt number."""
    found = []
    for folder in storage.subdirs():
        suffix = folder.name.removeprefix(f"{base}-")
        if folder.name.startswith(f"{base}-") and suffix.isdigit():
            found.append(Attempt(int(suffix), folder, read_record(folder.child(RUN_RECORD))))
    return sorted(found, key=lambda a: a.number)


def read_record(file: Storage) -> dict[str, Any]:
    try:
        record = json.loads(file.read_text())
    except (OSError, ValueError):  # missing (FileNotFoundError is an OSError) or not JSON
        return {}
    return record if isinstance(record, dict) else {}


def write_record(storage: Storage, name: str, record: Mapping[str, Any]) -> None:
    storage.child(name, RUN_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def choose_run(
    attempts: Sequence[Attempt], base: str, attention: str, resume: bool
) -> tuple[str, Attempt | None]:
    """(run name, finished attempt to reuse or None); prints the one line saying which."""
    stage = f"train@{attention}"
    done = next((a for a in reversed(attempts) if a.checkpoint is not None), None)
    if done is not None:
        say(f"{stage}: nothing to train: run {done.name} of this identity finished")
        return done.name, done
    if resume and attempts:
        last = attempts[-1]
        say(f"{stage}: resuming run {last.name} from its last epoch checkpoint")
        return last.name, None
    name = f"{base}-{attempts[-1].number + 1 if attempts else 1}"
    if not attempts:
        why = "no earlier run of this identity" + (" to resume" if resume else "")
    else:
        why = f"run {attempts[-1].name} of this identity did not finish; --resume continues it"
    say(f"{stage}: training from epoch 1 as run {name} ({why})")
    return name, None


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

"""Whether a folder is the output of a DVC stage: ``sat train`` and ``sat evaluate`` run a
stage outside DVC, and must not replace what ``dvc repro`` tracks behind its back (``dvc status``
would call the stage changed, and the next ``dvc repro`` would silently train again)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["stage_writing"]


def stage_writing(folder: Path) -> str | None:
    """The DVC stage whose output ``folder`` is (``train@soft``, or
    ``profiles/flickr8k/dvc.yaml:train@soft``), None outside a DVC repository or when no stage
    writes it."""
    from dvc.exceptions import DvcException, NotDvcRepoError
    from dvc.repo import Repo

    folder = Path(folder).resolve()
    existing = next(p for p in folder.parents if p.exists())  # models/ may not exist yet
    try:
        root = Repo.find_root(str(existing))
    except NotDvcRepoError:
        return None
    with Repo(root) as repo:
        try:
            outs = list(repo.index.outs)
        except DvcException:  # a dvc.yaml DVC cannot read: `dvc repro` would fail first
            return None
        for out in outs:
            if out.protocol == "local" and Path(out.fs_path).resolve() == folder:
                return str(out.stage.addressing)
    return None

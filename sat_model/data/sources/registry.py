"""The data sources' table: each entry is a reader, the settings model of its params section
(``data.<name>``, if it has settings), where its images are and whether it reads ``data.root``.

A source is one module: its settings model and its reader under ``@register_source(name,
settings=...)``. Params validation (:mod:`sat_model.params`), ``prepare`` and the params
reference read this table, so adding one touches no other file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from sat_model.config import DataConfig
from sat_model.data.datasets import missing_dataset
from sat_model.data.sources.records import SourceData, SourceError
from sat_model.registry import Registry

__all__ = [
    "SOURCES",
    "ImageRoot",
    "SourceEntry",
    "SourceReader",
    "dataset_missing",
    "image_root",
    "list_sources",
    "read_source",
    "register_source",
    "source_needs_root",
    "source_settings",
]

# (the source's settings, data.root, the prepared folder, decode workers) -> what it holds
SourceReader = Callable[[Any, Path, Path, "int | None"], SourceData]
# (the source's settings, data.root, the prepared folder) -> the folder its images are read from
ImageRoot = Callable[[Any, Path, Path], Path]


@dataclass(frozen=True)
class SourceEntry:
    """One registered source: what the rest of the code needs to know about it."""

    read: SourceReader
    images: ImageRoot
    needs_root: bool  # reads files under data.root (every source but the generated scenes)
    settings: type[BaseModel] | None  # its params section, data.<name>; None: it has none


SOURCES: Registry[SourceEntry] = Registry("data source", SourceError)


def register_source(
    name: str,
    *,
    settings: type[BaseModel] | None = None,
    images: ImageRoot | None = None,
    needs_root: bool = True,
) -> Callable[[SourceReader], SourceReader]:
    """Decorator: add the data source ``name`` (``data.source`` in params). ``settings`` is the
    model of its params section ``data.<name>`` (the reader gets it validated, or None);
    ``images`` says where its images are (default: ``data.root``)."""

    def add(read: SourceReader) -> SourceReader:
        where = images or (lambda settings, root, prepared: root)
        SOURCES.add(name, SourceEntry(read, where, needs_root, settings))
        return read

    return add


def list_sources() -> list[str]:
    """The registered data sources, sorted."""
    return sorted(SOURCES)


def source_needs_root(name: str) -> bool:
    """Whether source ``name`` reads files under ``data.root``."""
    return SOURCES[name].needs_root


def source_settings(data: DataConfig, name: str | None = None) -> Any:
    """The settings of source ``name`` (default: ``data.source``) from its section of ``data``,
    validated by its model (its defaults where params have no section); None without a model."""
    entry = SOURCES[name or data.source]
    if entry.settings is None:
        return None
    section = (data.model_extra or {}).get(name or data.source)
    if isinstance(section, entry.settings):
        return section
    return entry.settings.model_validate(section or {})


def image_root(data: DataConfig, base_dir: Path) -> Path:
    """The folder images are read from, from params alone (the one ``read_source`` reads).

    Relative ``data.root`` and ``data.prepared_dir`` resolve against ``base_dir``.
    """
    base = Path(base_dir)
    root = base / data.root if data.root else base
    entry = SOURCES[data.source]
    return entry.images(source_settings(data), root, base / data.prepared_dir).resolve()


def read_source(
    data: DataConfig, prepared_dir: Path, base_dir: Path, workers: int | None = None
) -> SourceData:
    """Read the source that ``data.source`` names."""
    root = base_dir / data.root if data.root else base_dir
    if missing := dataset_missing(data, base_dir):
        raise SourceError(missing)
    return SOURCES[data.source].read(source_settings(data), root, prepared_dir, workers)


def dataset_missing(data: DataConfig, base_dir: Path) -> str:
    """``""`` when what ``data.source`` reads is under ``data.root``, else the one line saying
    where to get it and where to put it (:mod:`sat_model.data.datasets`)."""
    if not SOURCES[data.source].needs_root:
        return ""
    root = (base_dir / data.root if data.root else base_dir).resolve()
    return missing_dataset(data, root, source_settings(data))

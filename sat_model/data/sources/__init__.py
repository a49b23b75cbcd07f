"""The caption sources: one module per reader, each with the settings model of its params
section (``data.<name>``), in a registry (:mod:`~sat_model.data.sources.registry`).

A reader parses its source's metadata only: which images exist, their split and file, and
their raw captions (:mod:`~sat_model.data.sources.records`). It never opens an image
(``sat_model.data.prepare`` checks files for every source alike). Importing this package
registers the built-in sources: the generated scenes, Flickr8k, Karpathy's splits, COCO and a
folder of your own photos.
"""

from sat_model.data.sources import coco, flickr8k, folder, karpathy, synthetic
from sat_model.data.sources.records import (
    EXCLUDED,
    LEAVES_FOLDER,
    OK,
    Skip,
    SourceCaption,
    SourceData,
    SourceError,
    SourceImage,
)
from sat_model.data.sources.registry import (
    dataset_missing,
    image_root,
    list_sources,
    read_source,
    register_source,
    source_needs_root,
    source_settings,
)

__all__ = [
    "EXCLUDED",
    "LEAVES_FOLDER",
    "OK",
    "Skip",
    "SourceCaption",
    "SourceData",
    "SourceError",
    "SourceImage",
    "coco",
    "dataset_missing",
    "flickr8k",
    "folder",
    "image_root",
    "karpathy",
    "list_sources",
    "read_source",
    "register_source",
    "source_needs_root",
    "source_settings",
    "synthetic",
]

"""Where Ray Train and Tune keep their runs, and how workers on other machines get the inputs.

``ray.storage_path`` is a local folder (relative to the project root) on one machine or a shared
file system, or an object-store URI (``s3://bucket/prefix``, anything
``pyarrow.fs.FileSystem.from_uri`` accepts) that every node of a cluster reaches. Both are a
:class:`Storage`: a ``pyarrow.fs`` file system and a path in it, which Ray Train takes as
``RunConfig(storage_path=..., storage_filesystem=...)``. S3 credentials and endpoint come from
the standard AWS variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), which pyarrow reads
and :data:`AWS_ENV` lists for the workers' runtime environment.

Worker inputs (``ray.worker_inputs``): ``shared`` workers open the driver's paths (one machine,
or a file system mounted alike on every node); ``upload``: the driver puts each input file into
the store once, under ``inputs/sha256/<digest>`` (a re-run finds it there and uploads nothing),
and each worker downloads them into a local temporary folder before training; ``auto``: shared
when the storage is a local folder (Ray Train then needs a shared file system anyway), upload
when it is a URI.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from sat_model.atomic import write_text_atomic

__all__ = [
    "AWS_ENV",
    "InputManifest",
    "Storage",
    "fetch_inputs",
    "resolve_storage",
    "upload_inputs",
    "workers_share_files",
]

# what S3 clients (pyarrow, s3fs, boto3) read from the environment; workers get the driver's
AWS_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
)


@dataclass(frozen=True)
class Storage:
    """A folder on the local disk or in an object store, as ``pyarrow.fs`` addresses it."""

    filesystem: pafs.FileSystem
    path: str  # in ``filesystem``: "/abs/folder" locally, "bucket/prefix" in S3
    uri: str  # for messages: the folder, or the scheme plus path

    @property
    def is_local(self) -> bool:
        return isinstance(self.filesystem, pafs.LocalFileSystem)

    def child(self, *parts: str) -> Storage:
        path = "/".join([self.path.rstrip("/"), *parts])
        uri = "/".join([self.uri.rstrip("/"), *parts])
        return Storage(self.filesystem, path, uri)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def is_dir(self) -> bool:
        return self.filesystem.get_file_info(self.path).type == pafs.FileType.Directory

    def is_file(self) -> bool:
        return self.filesystem.get_file_info(self.path).type == pafs.FileType.File

    def subdirs(self) -> Iterator[Storage]:
        """The folders directly in this one (none when it does not exist)."""
        selector = pafs.FileSelector(self.path, allow_not_found=True)
        for info in self.filesystem.get_file_info(selector):
            if info.type == pafs.FileType.Directory:
                yield self.child(info.base_name)

    def read_text(self) -> str:
        with self.filesystem.open_input_stream(self.path) as stream:
            return bytes(stream.read()).decode("utf-8")

    def write_text(self, text: str) -> None:
        """Write the file whole (an object store replaces an object in one step)."""
        if self.is_local:  # a reader never sees half a file: write beside, then rename
            write_text_atomic(Path(self.path), text)
            return
        with self.filesystem.open_output_stream(self.path) as out:
            out.write(text.encode("utf-8"))

    def download(self, destination: Path) -> None:
        """Copy this folder's content (or this file) to the local ``destination``."""
        pafs.copy_files(
            self.path,
            str(destination),
            source_filesystem=self.filesystem,
            destination_filesystem=pafs.LocalFileSystem(),
        )

    def upload(self, source: Path) -> None:
        """Copy the local file or folder ``source`` here."""
        pafs.copy_files(
            str(source),
            self.path,
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=self.filesystem,
        )


def resolve_storage(location: str, project_root: Path) -> Storage:
    """``ray.storage_path`` as a :class:`Storage`: a URI as given, a folder made absolute."""
    if "://" in location:
        try:
            filesystem, path = pafs.FileSystem.from_uri(location)
        except (ValueError, OSError) as err:  # pyarrow's ArrowInvalid is a ValueError
            raise ValueError(f"ray.storage_path {location!r} is not a usable URI: {err}") from err
        return Storage(filesystem, path.rstrip("/"), location.rstrip("/"))
    folder = Path(location).expanduser()
    folder = folder if folder.is_absolute() else (project_root / folder).resolve()
    return Storage(pafs.LocalFileSystem(), str(folder), str(folder))


def workers_share_files(setting: str, storage: Storage) -> bool:
    """``ray.worker_inputs``: True when workers may open the driver's paths."""
    if setting == "auto":
        return storage.is_local
    if setting in ("shared", "upload"):
        return setting == "shared"
    raise ValueError(f"ray.worker_inputs must be auto, shared or upload, got {setting!r}")


InputManifest = dict[str, str]  # local name (e.g. "features/train.arrow") -> path in the store


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def upload_inputs(files: Mapping[str, Path], storage: Storage) -> InputManifest:
    """Put each file into ``<storage>/inputs/sha256/<digest>`` unless it is there already.

    Content addressing makes a re-run (or another run on the same data) upload nothing, and a
    changed file a new object, so a worker never reads a stale copy.
    """
    manifest: InputManifest = {}
    for name, path in files.items():
        if not path.is_file():
            raise FileNotFoundError(f"input {path} of the Ray workers does not exist")
        blob = storage.child("inputs", "sha256", _sha256(path))
        info = blob.filesystem.get_file_info(blob.path)
        if info.type != pafs.FileType.File or info.size != path.stat().st_size:
            blob.filesystem.create_dir(blob.path.rsplit("/", 1)[0], recursive=True)
            blob.upload(path)
        manifest[name] = blob.path
    return manifest


def fetch_inputs(manifest: Mapping[str, str], storage: Storage, into: Path) -> Path:
    """Download the manifest's files under the local folder ``into``; returns ``into``."""
    for name, path in manifest.items():
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        Storage(storage.filesystem, path, path).download(target)
    return into

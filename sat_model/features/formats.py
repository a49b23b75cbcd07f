"""The image formats the project opens, as Pillow plugin names: only their parsers ever see a
file's or a request's bytes (a file of another format, an EPS named .jpg say, is refused, never
handed to Ghostscript). No torch here: prepare reads it too."""

from __future__ import annotations

__all__ = ["FILE_FORMATS", "REQUEST_FORMATS"]

# the raster formats a photo file may be in (prepare, extract, `sat caption`)
FILE_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")  # JPEG covers MPO
# those a served model takes by default (serve.formats): the web's photo formats
REQUEST_FORMATS = ("JPEG", "PNG", "WEBP")

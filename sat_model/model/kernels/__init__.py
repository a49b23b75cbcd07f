"""The backends of ``ShowAttendTell`` (docs/METHOD.md, "The backend"): how it is computed.

``model.backend`` in params.yaml names one, and the model factory injects it:

- ``native``: ``NativeBackend`` (``backend.py``) runs a training pass's recurrence
  (``recurrence.py``) on compiled kernels (``native.py``, ``native_kernels.cpp``) on float32
  CPU tensors, and the readable code elsewhere: decoding, under ``torch.compile`` where
  ``compile_decoding`` asks for it;
- ``readable``: no backend, autograd through ``decoder.py`` alone.
"""

from __future__ import annotations

from sat_model.model.decoder import Backend
from sat_model.model.kernels.backend import NativeBackend

__all__ = ["BACKENDS", "NativeBackend", "build_backend"]

BACKENDS = ("native", "readable")


def build_backend(name: str, *, compile_decoding: bool = False) -> Backend | None:
    """The backend named ``name`` (``model.backend``); None for the readable code alone.
    ``compile_decoding``: the native backend decodes through ``torch.compile``."""
    if name not in BACKENDS:
        raise RuntimeError(f"unknown model backend {name!r}; expected one of {BACKENDS}")
    return NativeBackend(compile_decoding) if name == "native" else None

"""The speed of ``ShowAttendTell`` as a backend, apart from the equations of ``decoder.py``.

- ``backend.py``: ``FastBackend``, which the model asks first for a pass or a decoding step,
  and which declines (the readable code runs) wherever it was not written for the case;
- ``fused.py``: the training recurrence as one autograd node with a hand-written backward;
- ``native.py`` and ``native_kernels.cpp``: compiled kernels of the attention and LSTM steps on
  float32 CPU tensors, built on first use; where they cannot be built, one warning and the
  PyTorch code of ``fused.py`` and ``backend.py`` instead.

The backend is chosen once, when the model is built: ``params.model.backend``, else the
environment variable ``SAT_MODEL_BACKEND``: ``fast`` (the default: all of the above), ``fused``
(the same without the compiled kernels, as where they cannot be built, and nothing is built) or
``readable`` (no backend: autograd through ``decoder.py``).
"""

from sat_model.model.kernels.backend import FastBackend

__all__ = ["FastBackend"]

"""Serving the champion over HTTP: the front door every engine sits behind
(:mod:`~pipeline.serving.front_door`), the model it serves, loaded with the installed code and
checked against its record (:mod:`~pipeline.serving.registered`), uvicorn in this process
(:mod:`~pipeline.serving.http_server`) and the ``sat serve`` command
(:mod:`~pipeline.serving.command`)."""

"""Everything that drives Ray: connecting or starting it (:mod:`~pipeline.ray.runtime`,
:mod:`~pipeline.ray.head` and its watchdog :mod:`~pipeline.ray.reaper`), Ray Train
(:mod:`~pipeline.ray.train`), Tune (:mod:`~pipeline.ray.tune`), feature extraction
(:mod:`~pipeline.ray.extract`), Ray Data captioning (:mod:`~pipeline.ray.caption`), Ray Jobs
(:mod:`~pipeline.ray.jobs`), object storage for runs and inputs (:mod:`~pipeline.ray.storage`)
and progress on the driver (:mod:`~pipeline.ray.progress`). Ray Serve is
:mod:`pipeline.serving.ray_engine`, beside the other serving engine."""

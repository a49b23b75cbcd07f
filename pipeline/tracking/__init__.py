"""Everything that drives MLflow: where the store is (:mod:`~pipeline.tracking.store`), runs,
retries and per-epoch logging (:mod:`~pipeline.tracking.runs`), what a run was built from
(:mod:`~pipeline.tracking.lineage`, :mod:`~pipeline.tracking.run_identity`), the model as MLflow
stores it (:mod:`~pipeline.tracking.packaging`, :mod:`~pipeline.tracking.pyfunc_model`), the
registry and its champion (:mod:`~pipeline.tracking.registry`,
:mod:`~pipeline.tracking.registration`), model URIs (:mod:`~pipeline.tracking.model_uri`) and
MLflow's own output kept quiet (:mod:`~pipeline.tracking.quiet`)."""

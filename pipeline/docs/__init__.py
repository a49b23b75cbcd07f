"""Sections of the docs generated from the code and the reports, so that they cannot drift: the
params reference (:mod:`~pipeline.docs.params`) and the results tables
(:mod:`~pipeline.docs.results`)."""

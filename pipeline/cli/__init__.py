"""The ``sat`` command (:mod:`~pipeline.cli.main`) and how every entry point reports a user
error in one line (:mod:`~pipeline.cli.user_errors`)."""

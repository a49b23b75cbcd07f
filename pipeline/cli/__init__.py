"""The ``sat`` command (:mod:`~pipeline.cli.main`); its subcommands share how a stage reports a
user error in one line (:mod:`~pipeline.stages.user_errors`)."""

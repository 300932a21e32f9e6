"""Shared code of the AMP scripts: one engine, one place each for args, data,
distributed setup, checkpoint IO and logging. The entry scripts in ``AMP/`` only
name their variant and call :func:`ampkit.train.main` or :func:`ampkit.evaluate.main`."""

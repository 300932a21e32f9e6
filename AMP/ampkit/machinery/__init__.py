"""The machinery under the training core: flags, errors, logs, data loading, checkpoint IO and
locks, saving and resuming, signals, memory and traces -- and, for benchmark.py and compare.py
only, measuring, reporting and the comparison's child processes. Nothing here teaches a
technique: the scripts in ``AMP/`` and the core (``ampkit.engine``, ``ampkit.train``,
``ampkit.precision``, ``ampkit.distributed``, ``ampkit.models``) do."""

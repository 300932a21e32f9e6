"""The plumbing under the training core: flags, errors, logs, the process's place in its
group, data loading, checkpoint IO and locks, saving and resuming, signals, memory and
traces. It imports nothing of the core (``ampkit.*``) and teaches no technique: the
scripts in ``AMP/`` and the core do."""

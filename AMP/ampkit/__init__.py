"""The training core the AMP scripts share: the loop around a script's step
(:mod:`ampkit.engine`), what a run stands on and its epochs' bookkeeping
(:mod:`ampkit.train`), evaluation, precision, distributed set-up and the networks. Each
script in ``AMP/`` builds its own technique (wrapper, precision objects, training step)
and runs its own epochs; the plumbing beneath is :mod:`ampkit.machinery`."""

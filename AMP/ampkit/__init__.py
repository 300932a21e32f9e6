"""The training core the AMP scripts share: what a script's ``build()`` takes and returns
(:mod:`ampkit.technique`), the loop around its step (:mod:`ampkit.engine`), what a run
stands on and its epochs' bookkeeping (:mod:`ampkit.train`), evaluation, precision, distributed set-up and the networks. Each
script in ``AMP/`` builds its own technique (wrapper, precision objects, training step)
and runs its own epochs; the plumbing beneath is :mod:`ampkit.machinery`."""

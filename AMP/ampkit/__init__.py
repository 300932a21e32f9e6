"""The training core the AMP scripts share: what a script's ``build()`` takes and returns
(:mod:`ampkit.technique`), the loop around its step (:mod:`ampkit.engine`), the run folder,
resume, saver and epoch figures a script calls (:mod:`ampkit.train`), evaluation,
precision, the process group (:mod:`ampkit.distributed`) and the networks. Each
script in ``AMP/`` builds its own technique (wrapper, precision objects, training step)
and runs its own epochs; the plumbing beneath is :mod:`ampkit.machinery`."""

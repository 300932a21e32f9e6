"""What the AMP scripts share: flags, distributed setup, data, checkpoints, logging, the
epoch loop and measuring. Each script in ``AMP/`` builds its own technique (wrapper,
precision objects, training step) and hands it to :class:`ampkit.train.Trainer` or
:class:`ampkit.evaluate.Evaluation` for the rest."""

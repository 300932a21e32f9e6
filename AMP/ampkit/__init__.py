"""The training code the AMP scripts share. Each script in ``AMP/`` builds its own technique
(wrapper, precision objects, training step) and runs its own epochs; it stands on:

- the epoch: :mod:`.engine` (``Technique``, ``train_one_epoch``, ``count_correct``, the
  progress bars) and :mod:`.meters` (every figure of the epoch and the run, the profiler);
- the run: :mod:`.run` (its folder, log and exit), :mod:`.stop` (signal, vote, exit status),
  :mod:`.checkpoint` (saving, resuming), :mod:`.flags`;
- the process group: :mod:`.distributed` (the one module that talks to it, and DDP's comm
  hooks);
- the data: :mod:`.data`; the networks and their FLOPs: :mod:`.models`;
- this process: :mod:`.device` (which device, what it refuses, what it computes in, its
  peak), :mod:`.errors`, :mod:`.randomness`; the eval scripts' driver: :mod:`.evaluate`.
"""

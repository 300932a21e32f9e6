"""The training code the AMP scripts share. Each script in ``AMP/`` builds its own technique
(wrapper, precision objects, training step) and runs its own epochs; it stands on:

- the epoch: :mod:`.engine` (``train_one_epoch``, ``count_correct``), :mod:`.meters` (the
  epoch's figures), :mod:`.technique` (what a script's ``build()`` takes and returns);
- the run: :mod:`.run_folder` (its folder, logger and last line), :mod:`.checkpoint`
  (saving, resuming), :mod:`.signals` (stops), :mod:`.log`, :mod:`.flags`;
- the process group: :mod:`.distributed`, the one module that talks to it;
- the data: :mod:`.data`; the networks: :mod:`.models`; precision: :mod:`.precision`;
  DDP's comm hooks: :mod:`.comm_hooks`; FLOPs and peaks: :mod:`.flops`;
- this process: :mod:`.device`, :mod:`.errors`, :mod:`.randomness`.
"""

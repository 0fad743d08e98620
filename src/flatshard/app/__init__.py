"""Layer 8, the application on top of the library: the ``flatshard`` CLI (``cli``, with
what its commands share in ``cli_args`` and ``flatshard plan`` in ``plan_command``), its
training loop and report (``train``, ``train_report``), the local launcher (``launcher``), the
benchmark and its peers (``bench``, ``peers``) and layout drawings (``draw``)."""

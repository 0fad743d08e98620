"""Layer 8, flatshard inside other libraries' training loops: ``hf`` (``transformers.Trainer``
and the trainers built on it), ``accelerate`` (``Accelerator.prepare``), ``lightning``
(Lightning's ``Trainer``, ``strategy="flatshard"``), ``pipelining`` (torch's pipeline
schedules over flatshard chunks) and ``optimizers`` (a host user's torch optimizer rebuilt as
a ``DistributedOptimizer``) and ``scaler`` (a host's ``GradScaler`` made a
``ShardedGradScaler``). [Note: hosted training] in ``hf.py``."""

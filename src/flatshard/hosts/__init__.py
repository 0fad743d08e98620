"""Layer 8, flatshard inside other libraries' training loops: ``hf`` (``transformers.Trainer``
and the trainers built on it), ``accelerate`` (``Accelerator.prepare``) and ``lightning``
(Lightning's ``Trainer``, ``strategy="flatshard"``). [Note: hosted training] in ``hf.py``."""

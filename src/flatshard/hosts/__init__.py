"""Layer 8, flatshard inside other libraries' training loops: ``hf`` (``transformers.Trainer``
and the trainers built on it) and ``accelerate`` (``Accelerator.prepare``). [Note: hosted
training] in ``hf.py``."""

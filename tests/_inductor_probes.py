"""Imported once by the suite's forkserver (``PRELOAD`` in ``conftest.py``), so that every
rank forked from it inherits what inductor otherwise works out afresh in each process
before its first compile or cache load: which vector instruction sets the CPU's compiler
can build and load (a test build and a probe subprocess per set, about 2.5 s) and the hash
of torch's own sources that keys its caches (about 0.4 s). Both are cached per process by
inductor itself; this only fills the caches before the fork. Measured on a compile test's
rank: 4.3 s -> ~1 s for its first step."""

from torch._inductor import codecache, cpu_vec_isa

cpu_vec_isa.valid_vec_isa_list()
codecache.torch_key()

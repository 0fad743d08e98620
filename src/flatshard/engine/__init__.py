"""Layer 2, the engine of every stage: flat buffers laid out by ``flatshard.planner.layout``
(``buffer``), the reductions of their buckets (``reduction``), the backward's grad-sync
state machine (``grad_sync``), which params got a grad on any rank (``grad_usage``), a
param's ``.grad`` where the grads live in buffers (``grad_view``), the named states of all
of these (``lifecycle``), the param all-gathers after a step at stages 1-2
(``param_gather``), weights gathered as fp8 bytes (``fp8_gathers``), the hook wrappers that
keep flatshard out of Dynamo's graphs (``dynamo``), a tensor-parallel model's DTensor params
held by their local shards (``tensor_parallel``) and tensors that keep their values in inner
tensors (``wrapper_tensors``). Uses ``flatshard.comm``; knows no optimizer."""

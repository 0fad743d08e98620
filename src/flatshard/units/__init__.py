"""Layer 3, stage 3: the units found in the module tree (``unit_tree``), each buffer's full
buckets (``full_buckets``) and the placeholders its params are between uses
(``placeholder``), one bucket of a unit and its gather (``parts``), gathering each unit's
params around its use and freeing them after (``unshard``), with the ranks' agreement at
each entry into gathering (``entries``), building that and initializing meta-device models
unit by unit (``build``), and full params on demand (``full_params``). Uses the engine and
``flatshard.comm``."""

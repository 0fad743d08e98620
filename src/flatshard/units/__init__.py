"""Layer 3, stage 3: gathering each unit's params around its use and freeing them after
(``unshard``), building that and initializing meta-device models unit by unit (``build``),
and full params on demand (``full_params``). Uses the engine and ``flatshard.comm``."""

"""Layer 6, checkpoint and weights I/O: checkpoint directories written and read by every
rank, with their manifest and destinations (``directory``), what each rank writes as pieces
(``state``), the DCP planners and checksums for those pieces (``pieces``), single-file
weights (``files``: safetensors and ``.pt``, streamed and checksummed) and export / seeding
from them (``weights``)."""

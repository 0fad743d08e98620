"""Layer 6, checkpoint and weights I/O: checkpoint directories written and read by every
rank (``directory``), saves written in the background (``background``) and the snapshot the last
one leaves in host memory for a load to read (``snapshot``), the newest complete
one under a directory (``latest``), where a save may write and how it becomes visible
(``destination``), what each rank writes as pieces (``state``), the whole model when ranks
hold pipeline chunks (``chunks``), the DCP planners and checksums for those pieces
(``pieces``), single-file weights (``files``: safetensors and ``.pt``, streamed and
checksummed), export and seeding from them (``weights``), and Hugging Face directories in and
out of a sharded model (``pretrained``)."""

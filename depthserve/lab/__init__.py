"""Offline tools, run by people and tests rather than by the server: tiny random checkpoints of
every architecture (`make_tiny`, `tiny/`), the demo models' training (`demo/`), SGT's checkpoint
converter and training-free graft (`sgt_import`, `sgt_graft`) and ITT's router calibration
(`itt_calibrate`). The serving engine imports none of it: an architecture's registration names its
tiny module and tools by dotted path, imported only when their command runs."""

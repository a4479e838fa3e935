"""Output formats: each writer streams one output into a staging directory (see :mod:`.base`)."""

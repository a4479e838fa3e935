"""DeepSpeed ZeRO reader (not yet available)."""

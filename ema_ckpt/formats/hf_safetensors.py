"""Hugging Face safetensors reader (not yet available)."""

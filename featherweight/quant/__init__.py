"""Quantization: NF4 with double quantization (QLoRA)."""

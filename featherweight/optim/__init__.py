"""Optimizers as optax transformations (8-bit AdamW with block-wise quantized moments)."""

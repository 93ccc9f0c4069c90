"""Using a model: logits, and text generation with a KV cache (base + adapters)."""

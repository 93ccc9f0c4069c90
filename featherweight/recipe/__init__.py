"""From a training config to its parts: the config schema, the optimizer, the trainable/frozen split, the built step."""

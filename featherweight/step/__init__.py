"""Train steps: the layer-streamed step (optimizer inside the backward pass) and the jax.grad reference."""

"""The Llama family as pure functions over stacked parameter pytrees, with configs and shapes."""

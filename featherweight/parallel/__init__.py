"""Where arrays live: host memory kinds inside a step, meshes and partition rules, multi-host start-up."""

"""Tensor parallelism: N rank processes per engine, rank 0 (the engine's own process) schedules and every
rank runs each step on its share of the weights and KV heads (docs/architecture.md, "Tensor parallelism")."""

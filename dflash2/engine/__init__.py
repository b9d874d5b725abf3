"""The engine: scheduling, KV bookkeeping, model execution and the step loop."""

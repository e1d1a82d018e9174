"""Executors, workers, the KV cache tensors and the model runner."""

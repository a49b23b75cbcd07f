"""Batching, the generic trainer and one training run."""

"""The Show, Attend and Tell network, its losses, decoding and checkpoints."""

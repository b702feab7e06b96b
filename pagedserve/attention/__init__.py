"""Paged attention: metadata, backends (PyTorch reference, Triton) and the forward context."""

"""Latent and text-embedding cache keyed by content and encoder identity (see keys.py)."""

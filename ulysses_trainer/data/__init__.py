"""Tokenizers, datasets and the long-document builder."""

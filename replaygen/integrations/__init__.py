"""Serving frameworks' models decoding through generated modules."""

"""Datasets and prompt templates (no Ray)."""

"""Checkpoint discovery and loading: built-in names, GGUF files, Hugging Face directories."""

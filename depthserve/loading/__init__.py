"""Checkpoint discovery and reading: built-in names, GGUF files, Hugging Face directories, the
native format's shared parts and tokenizers. Nothing here knows an architecture: the model is
built from what is read by depthserve/engine/model_loader.py."""

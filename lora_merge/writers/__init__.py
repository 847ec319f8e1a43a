"""Output writers: they receive finished HuggingFace tensors and files and know nothing of merging."""

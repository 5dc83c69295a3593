"""lightning-ffpa: train Hugging Face Gemma4 fast with PyTorch Lightning."""

__version__ = "0.1.0"

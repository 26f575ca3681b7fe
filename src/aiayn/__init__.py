"""aiayn: a trainer for the Transformer of "Attention Is All You Need"."""

__version__ = "0.1.0"

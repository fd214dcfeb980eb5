"""jobrun: run PyTorch training jobs described by declarative YAML plans."""

__version__ = "0.1.0"

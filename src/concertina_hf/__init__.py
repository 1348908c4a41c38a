"""concertina_hf: data-centric adaptive pipeline parallelism for Hugging Face models."""

__version__ = "0.1.0.dev0"

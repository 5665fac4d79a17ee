"""staging-twin: a digital twin of SGLang's staging-buffer KV-transfer protocol."""

__version__ = "0.1.0"

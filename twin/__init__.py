"""staging-twin: a digital twin of SGLang's staging-buffer KV-transfer protocol."""

from twin import compiled as _compiled

__version__ = "0.1.0"

_compiled.activate()  # before any protocol module is imported: compiled core, or its sources

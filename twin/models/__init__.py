"""Named models and GPUs, and the compute costs and memory they imply.

``catalog``: models (KV geometry, sizes) and GPUs; ``profile``: measured prefill/decode tables
shipped as package data; ``costs``: the compute-cost model and KV pools a simulation uses;
``derive``: regenerates the profiles from aiconfigurator (optional extra).
"""

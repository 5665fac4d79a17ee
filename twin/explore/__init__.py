"""Logical-time exploration of the protocol core: any delivery order, no clocks."""

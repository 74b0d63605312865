"""kvq: serve the routed experts of MoE language models across many machines over Redis streams."""

__version__ = "0.1.0"

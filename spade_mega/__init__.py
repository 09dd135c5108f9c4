"""spade-mega: SPADE self-play (one LLM designs executable environments and learns to solve them) at Megatron scale."""

__version__ = "0.1.0"

"""Stores read by engines of another shape than the one that saved a chunk.

What belongs here: what lets any store transport serve an engine whose shape differs
from the saver's, built on the transport contract and `kvflow.geometry`. `reshape`
(chunks saved at another tensor-parallel size: which shards to look up and read, and
how a rank takes its heads from them), `reblock` (chunks saved at another block size:
which hold a load's tokens, and how their bytes land in this engine's blocks) and
`replicas` (ranks that replicate KV heads keep them in a store once). The engine's
scheduler and worker call them; they know nothing of vLLM or of a transport's kind.
"""

__all__: list[str] = []

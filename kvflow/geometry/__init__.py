"""KV geometry: where a cache's bytes lie, and which rank holds which heads.

What belongs here: descriptions of paged KV memory and the arithmetic over them, with
no transfer, no loop and nothing of vLLM. `layout` (a layer's blocks as byte spans:
`KVLayout`, `LayerGeometry`), `cells` (one token of one head, the unit that is
contiguous in every layout: which bytes of one block go where in another layout, head
count or block size; numpy), `views` (the same as torch views of a device cache, for
the CUDA paths) and `topology` (which KV heads each tensor-parallel rank holds, and
which producer ranks a consumer rank reads). It imports nothing else of kvflow: the
transport contract, the stores read across shapes (`kvflow.shapes`) and the engine
build on it.
"""

__all__: list[str] = []

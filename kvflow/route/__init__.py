"""Where a request goes among instances serving whole requests (`kvflow proxy --server`,
issue 52): by the prompt's prefix as the instances' KV events announce their blocks.

- `events`: vLLM's KV event stream read without vLLM, every field bounded.
- `index`: `PrefixIndex`, block -> the instances holding it and in which media, keyed by
  chain hashes of token ids; a memory bound.
- `feeds`: one instance's stream into the index (replays, restarts).
- `router`: `Router`, the choice (prefix within a load bound, round robin, random).
- `service`: `Routing`, all of it as the proxy runs it (health checks, tokenization).
"""

from .index import Match, PrefixIndex
from .router import Decision, Router
from .service import Routing

__all__ = ["Decision", "Match", "PrefixIndex", "Router", "Routing"]

"""`fs`: content-addressed KV chunk files in a local or shared directory.

kvflow's embedded default. One file per chunk and shard:
`<root>/<namespace>/<key[:2]>/<key>.<shard>.kv`, holding a 4 KiB header
(magic, key, namespace, shard, token count, per-layer byte counts and XXH3-64s, or
under a store key keyed BLAKE3s)
and then the layers' bytes, page-aligned. Files appear atomically (temp file +
rename), are read with `preadv` straight into vLLM's KV blocks, and are
validated on read: a missing, truncated, foreign or corrupt file becomes a
load error that vLLM recomputes, and a bad file is deleted so that the next
save of its key writes it again. A size cap evicts least-recently-used files.
The store is owner-only by default (`file_mode`, for its directories, root included,
and files); a root or namespace directory of another user's, or writable beyond
`file_mode`, is refused at open (`_perms`).
"""

from __future__ import annotations

from ._transport import FsOptions, FsTransport

__all__ = ["FsOptions", "FsTransport"]

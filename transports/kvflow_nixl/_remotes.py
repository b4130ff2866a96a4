"""A consumer's producers: each producer's NIXL agent, added once, and its KV memory,
prepared once, from the first pull's `Blocks` (a new agent name at the same address
means the producer restarted).

A producer is *forgotten* when it restarts or a READ from it could not be drained;
if pulls still read with it then, it stays added (`stale`) until the last of them
ends, and a broken one is never taken back (it is added anew once those pulls end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.geometry.layout import KVLayout, peer_cells_problem
from kvflow.transport import ChunkCorrupt, TransportError
from kvflow.zmqio import shown

from . import _wire as wire
from ._descs import Table, prepare, release, remove_agent

__all__ = ["Remote", "RemoteAgents"]


@dataclass
class Remote:
    """A producer agent this consumer added, and its KV memory, prepared."""

    name: str
    table: Table
    bases: list[tuple[int, int]]
    memory: str
    users: int = 0
    """Pulls reading with this agent right now."""
    broken: bool = False
    """A READ with it could not be drained: forget it, never take it back."""

    @property
    def shown(self) -> str:
        """Its name as logs and errors show it (the producer chose it: escaped, cut)."""
        return shown(self.name)


class RemoteAgents:
    """The producers this consumer pulls from, by side-channel address."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.by_address: dict[str, Remote] = {}
        self.stale: dict[str, Remote] = {}
        """Agents forgotten while a pull still used them; its last user removes them."""

    def known(self, address: str) -> str:
        """The agent this consumer added for `address` ("" if none): its metadata need
        not be sent again."""
        remote = self.by_address.get(address)
        return remote.name if remote is not None else ""

    def acquire(self, agent: Any, address: str, msg: wire.Blocks, layout: KVLayout) -> Remote:
        """The producer that answered `msg`, added if new, counted as used by this pull
        until `release`."""
        remote = self._find(agent, address, msg, layout)
        remote.users += 1
        return remote

    def release(self, agent: Any, address: str, remote: Remote, drained: bool) -> None:
        """A pull with `remote` ended; `drained` False: one of its READs could not be
        drained, so the agent is forgotten and never taken back."""
        remote.users -= 1
        if self.stale.get(remote.name) is remote and not remote.users:
            del self.stale[remote.name]
            self._retire(agent, remote)
        if not drained:
            remote.broken = True
            if self.by_address.get(address) is remote:  # not a newer one another pull added
                self._forget(agent, address)

    def close(self, agent: Any) -> None:
        """Remove every agent (the transport closes; no pull runs any more)."""
        for address in list(self.by_address):
            self._forget(agent, address)
        for remote in self.stale.values():
            remote.users = 0
            self._retire(agent, remote)
        self.stale.clear()

    def _find(self, agent: Any, address: str, msg: wire.Blocks, layout: KVLayout) -> Remote:
        cached = self.by_address.get(address)
        if cached is not None and cached.name == msg.agent:  # concurrent first pulls too
            return cached
        if msg.agent in self.stale:  # forgotten, but still added
            if self.stale[msg.agent].broken:
                raise TransportError(
                    f"a READ from {address} failed; its NIXL agent is re-added once the "
                    "pulls still using it end"
                )
            self._forget(agent, address)  # take it back
            remote = self.by_address[address] = self.stale.pop(msg.agent)
            return remote
        if not msg.metadata or msg.regions is None:  # we forgot it while it answered
            raise TransportError(f"producer {address} sent no NIXL metadata for {shown(msg.agent)}")
        regions = msg.regions
        why = peer_cells_problem(regions.geometries, layout.geometries, any_block_size=True)
        if why or len(regions.bases) != len(regions.geometries):
            raise ChunkCorrupt(f"producer {address}: {why or 'bad regions'}")
        self._forget(agent, address)
        try:
            added = agent.add_remote_agent(msg.metadata)
        except Exception as exc:
            raise TransportError(f"NIXL rejected the metadata of {address}: {exc}") from None
        name = added.decode() if isinstance(added, bytes) else str(added)
        if name != msg.agent:
            remove_agent(agent, name)
            raise ChunkCorrupt(
                f"producer {address} sent metadata of {shown(name)}, not {shown(msg.agent)}"
            )
        try:
            table = prepare(
                agent, name, regions.bases, regions.geometries, msg.memory, self.backend
            )
        except Exception as exc:
            remove_agent(agent, name)
            raise TransportError(f"NIXL cannot prepare the memory of {address}: {exc}") from None
        remote = self.by_address[address] = Remote(name, table, regions.bases, msg.memory)
        return remote

    def _forget(self, agent: Any, address: str) -> None:
        """Drop the producer at `address` (it restarted, or a READ of it failed)."""
        remote = self.by_address.pop(address, None)
        if remote is not None:
            self._retire(agent, remote)

    def _retire(self, agent: Any, remote: Remote) -> None:
        """Release a producer's prepared list and agent, or leave that to the last pull
        still reading with them."""
        if remote.users:
            self.stale[remote.name] = remote
            return
        release(remote.table.dlist)
        remove_agent(agent, remote.name)

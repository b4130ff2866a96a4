"""Tiers in front of a store transport: a bounded host-memory cache (`host`), the order
in which it gives chunks up (`policy`), and the transport wrapper (`tiered`)."""

from .host import HostCache, TierCounters
from .policy import LRU, POLICIES, S3FIFO
from .tiered import HostTier, with_host_tier

__all__ = ["LRU", "POLICIES", "S3FIFO", "HostCache", "HostTier", "TierCounters", "with_host_tier"]

"""Tiers in front of a store transport: a bounded host-memory cache (`host`), the order
in which it gives chunks up (`policy`), the transport wrapper (`tiered`), and stores
stacked one below another (`stacked`)."""

from .host import HostCache, TierCounters
from .policy import LRU, POLICIES, S3FIFO
from .stacked import StackedStore, stack_of, stacked, tiers_of
from .tiered import HostTier, with_host_tier

__all__ = [
    "LRU",
    "POLICIES",
    "S3FIFO",
    "HostCache",
    "HostTier",
    "StackedStore",
    "TierCounters",
    "stack_of",
    "stacked",
    "tiers_of",
    "with_host_tier",
]

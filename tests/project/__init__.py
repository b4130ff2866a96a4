"""The repository itself: layering and public API, packaging, docs, bench pages, scripts."""

"""Tests that need an NVIDIA GPU (skipped without one): scripts/gpu-check.sh runs them."""

"""kvflow's core modules on their own: no vLLM, no transport."""

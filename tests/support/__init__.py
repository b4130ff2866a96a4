"""Helpers shared by the test modules (no test module imports another): what drives
kvflow's engines, vLLM's Scheduler, engines and servers, stores, stand-ins, attackers."""

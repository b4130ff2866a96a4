"""Prefill/decode: leases, the head topology between parallel shapes, P/D in kvflow's
engines and in vLLM's real Scheduler, pipeline stages, `kvflow proxy`."""

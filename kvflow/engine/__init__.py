"""The engine: kvflow's side of vLLM's scheduler and of each worker.

What belongs here: the state machines vLLM's calls drive (through the adapter,
`kvflow_vllm`) and the transfers they start. `scheduler` (`SchedulerEngine`: lookups,
load, save and offer plans, P/D claims), `metadata` (the plan it sends each worker, as
msgspec), `worker` (`WorkerEngine`: binds a plan, gates layers, reports results),
`transfers` (a task per load, save and offer on the runtime's loop, each with its
deadline), `lending` (the life of a request's blocks while transfers use them),
`staging` (host staging for a device cache and a host-memory store) and `cpu_pinning`
(other engines' workers pinned to this one's cores). It builds on the rooms below it
(geometry, shapes, observe, pd, the transport contract, the runtime); of kvflow, only
the conformance suites (`kvflow.testing`) use it, to stage as the engine does.
"""

__all__: list[str] = []

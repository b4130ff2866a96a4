"""Transports and stores on real files and sockets: the conformance suites, `fs`, `zmq`,
`nixl`, the host tier and stacked stores, staging, layouts, reblock, reshape, outages."""

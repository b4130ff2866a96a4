"""HTTP/1.1 on trio with h11, for `kvflow proxy` (decision 103): the server that answers
its clients under the limits a server facing untrusted clients needs (`server`), and
the client that calls the servers behind it, connections kept alive (`client`)."""

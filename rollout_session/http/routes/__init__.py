"""Routes served through Quart: sessions (create, read, collect, bulk),
the operator's (workers, pause, metrics) and the trajectory inspector."""

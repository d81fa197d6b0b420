"""Many session servers: ``serve --processes N`` on one host, and Ray actors.

Owns: starting a fleet's shards as processes (`processes`) and as Ray
actors (`ray.start_fleet`, the ``ray`` extra). What a shard does with
requests for sessions it does not own is the HTTP edge's
(`http.fleet`).

May import: the server's run and option modules of `cli` (`cli.run`,
`cli.options`, `cli.demo` for demo fleets), `http`, `config`, `client`.
"""

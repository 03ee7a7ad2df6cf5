"""`lmi tune` (docs/tune.md): the command (command.py), the candidates of this host (space.py), the search
(search.py), a trial's real server (server.py) under the load (load.py, workload.py), the fresh
comparison (verify.py), the table, JSON and plot (report.py, output.py)."""

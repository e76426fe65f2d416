"""Communication: MPI bootstrap, the Context, its two data planes, payloads, tags, trace."""

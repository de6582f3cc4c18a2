"""The user-facing side: the `specroute` CLI, the router's core logic with its OpenAI-compatible HTTP
routes and the Ray Serve application that serves them (`specroute serve`), per-request advice, and
the `bench load` load generator with its report."""

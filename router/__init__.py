"""The user-facing side: the `specroute` CLI (and, later, the Ray Serve ingress)."""

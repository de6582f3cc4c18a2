"""Measurements on the machine specroute runs on: benchmarks, hardware limits, (later) profiles."""

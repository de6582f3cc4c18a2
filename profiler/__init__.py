"""Measurements on the machine specroute runs on: the benchmarks (`bench plain`, `bench spec`,
`bench model-fit`), hardware limits, the versioned profile and its capacity-planning report, and
the α predictor fitted from it on prompt features."""

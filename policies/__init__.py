"""Routing policy: the cost model, the policy config and `decide()`.

Pure Python + numpy by design: every routing decision can be unit-tested without Ray or torch.
"""

"""Training drafters on the target's own outputs: a generated prompt set, self-distilled
responses and features, and time-budgeted training loops (`specroute train-drafter`)."""

"""Live recovery: optimizer-state fragments and their redundant copies, recovery plans, and the manager that turns
a failure into a new generation's engine."""

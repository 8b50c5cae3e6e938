"""Live recovery: recovery plans, re-slicing of optimizer state, and the manager that turns a failure into a new
generation's engine."""

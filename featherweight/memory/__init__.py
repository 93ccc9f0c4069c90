"""The memory planner: every byte of a train step planned from shapes, measured on the compiled step, fitted to budgets."""
